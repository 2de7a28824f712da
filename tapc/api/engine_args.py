"""The vLLM engine arguments a tap plan needs, merged into the user's own, and the checks that
refuse what a tapped engine cannot run. They are made and checked on the caller's side only
(what crosses to vLLM's processes is the `EngineConfig` in them, tapc/wire/config.py), so they
live with the API, which builds engines through tapc/api/engine.py.

- `worker_cls`: tapc's worker, which installs the taps after the model loads (a qualified
  name, so it resolves in the engine-core and worker processes).
- `additional_config["tapc"]`: the `EngineConfig`, with the plan (JSON) and a digest of the plan
  and of the code that runs inside the graphs. vLLM hashes `additional_config` into its
  compile-cache key, so a new plan or changed tap code never reuses stale compiled graphs.
- prefix caching is left as the user sets it (vLLM's default: on). Tokens served from the
  prefix cache skip the forward, so the API decides per request what it may read and share
  (tapc/api/prefix.py: captures of prompt rows read no cache, edits get a `cache_salt`).
- on several GPUs (tensor / pipeline parallel sizes as the plan was built for): vLLM's
  multiprocessing executor, one worker process per GPU, unless the user asks for its Ray
  executor (`"ray"`: a worker per GPU as Ray actors, placed by Ray, on several nodes too);
  the worker answers tapc's calls alike under both (docs/distributed.md).
Compilation settings are left as the user gave them (vLLM's default: FULL_AND_PIECEWISE),
except that with Python blocks `tapc::boundary` joins vLLM's splitting ops: PIECEWISE graphs
split there, and FULL graphs are captured broken there (graphs.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tapc import settings
from tapc.errors import EngineError
from tapc.wire.config import EngineConfig
from tapc.wire.node import shm_identity

if TYPE_CHECKING:   # a plan is what the API hands in; this side needs only its methods
    from tapc.plan.tapplan import TapPlan

WORKER = "tapc.worker.worker.TapWorker"
# vLLM's executors a tapped engine runs on several GPUs: each worker answers tapc's calls through
# the executor's RPCs, and sends its rows there when it sees other shared memory (another node)
SEVERAL_GPUS = ("mp", "ray")

# Modules whose code ends up inside the compiled graphs, or decides what does (which call a
# `.source` tap wraps, which op and tables an edit reads, the tables' shapes): a change to any of
# them must invalidate vLLM's compile cache. tests/worker/test_digest.py runs an install and the
# patched forwards and fails if a tapc file they run is missing here.
GRAPH_MODULES = ("tapc.worker.install", "tapc.worker.source", "tapc.worker.calls", "tapc.lang.functions",
                 "tapc.worker.layout", "tapc.plan.forwards", "tapc.lang.edits",
                 "tapc.plan.sizing", "tapc.plan.ranks", "tapc.plan.sharding", "tapc.plan.lens",
                 "tapc.plan.pattern")
GRAPH_PACKAGES = ("tapc.kernels",)   # every module of these


def require_cuda() -> None:
    """Refuse at once, in one line, where there is no CUDA GPU: vLLM would start and fail seconds
    later in a page of traceback ("Device string must not be empty"); and where Triton's
    interpreter is switched on, which the engine's processes inherit: inductor's kernels then run
    on the CPU and the engine dies compiling its graphs."""
    import torch

    if not torch.cuda.is_available():
        raise EngineError("the engine needs a CUDA GPU, and torch sees none here; `tapc explain` shows "
                          "the plan on any machine")
    if triton_interpreter():
        raise EngineError(f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']!r} switches on Triton's interpreter, "
                          "under which vLLM's compiled graphs cannot run on a GPU: unset it to start an engine")


def triton_interpreter() -> bool:
    """Whether TRITON_INTERPRET switches Triton's interpreter on, read as Triton reads it."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def engine_kwargs(plan: TapPlan, kwargs: dict, **fields) -> tuple[dict, EngineConfig]:
    """vLLM `LLM(...)` keyword arguments for `plan`, from the user's `kwargs` (tapc's own
    `capture_memory_gib`, `capture_memory_keep_gib` and `prefix_rows_gib` among them: the worker
    reads them from the config), and the config they carry. `fields`: more of the config's
    fields (functions, a server's spec, blocks and save folder)."""
    out = dict(kwargs)
    if out.get("enable_expert_parallel"):
        refuse_expert_parallel()
    reserve = capture_memory(out.pop("capture_memory_gib", None))
    keep = capture_keep(out.pop("capture_memory_keep_gib", None))
    rows = prefix_rows(out.pop("prefix_rows_gib", None), plan, out.get("distributed_executor_backend"),
                       out.get("data_parallel_size", 1))
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if out.get(name, 1) != getattr(plan, name):
            raise EngineError(f"{name}={out.get(name, 1)} but the plan was built for {getattr(plan, name)}")
    if plan.tensor_parallel_size * plan.pipeline_parallel_size > 1:
        backend = out.get("distributed_executor_backend")
        if backend not in (None, *SEVERAL_GPUS):
            raise EngineError(f"distributed_executor_backend={backend!r}: tapped engines on several GPUs run vLLM's "
                              "multiprocessing executor (\"mp\", the default) or its Ray executor (\"ray\") "
                              "(docs/distributed.md)")
        out["distributed_executor_backend"] = backend or "mp"
    if out.get("worker_cls", "auto") not in ("auto", WORKER):
        raise EngineError(f"worker_cls={out['worker_cls']!r}: a tapped engine runs tapc's worker ({WORKER})")
    out["worker_cls"] = WORKER
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        if out.get(name, getattr(plan, name)) != getattr(plan, name):
            raise EngineError(f"{name}={out[name]} but the plan was built for {getattr(plan, name)}")
        out[name] = getattr(plan, name)
    if plan.splitting_ops:
        out["compilation_config"] = _with_splits(plan, out.get("compilation_config"))
    # rings change the graphs (the capture ops' arguments): in the hashed config, as everything is
    config = EngineConfig(plan=plan.to_json(), graph_digest=digest(plan), api_shm=shm_identity(),
                          rings=settings.TAPC_RINGS, capture_memory=reserve, capture_keep=keep, prefix_rows=rows,
                          **fields)
    out["additional_config"] = config.into(out.get("additional_config"))
    return out, config


def refuse_expert_parallel() -> None:
    """Expert parallelism moves experts, and the rows routed to them, between GPUs: the layout of
    router and expert captures under it is not built, so a tapped engine refuses it."""
    raise EngineError("enable_expert_parallel: a tapped engine does not run expert parallelism yet (router and "
                      "expert taps under it are not built); leave it off: tensor parallelism runs MoE models "
                      "(docs/distributed.md)")


def capture_memory(gib) -> int:
    """Bytes of `capture_memory_gib`: host memory for captures each GPU's worker makes and pins
    at start (arena.py `reserve`), so that requests admitted up to that much never wait for it."""
    return _gib_bytes("capture_memory_gib", gib, "captures each GPU pins at the engine's start")


def capture_keep(gib) -> int | None:
    """Bytes of `capture_memory_keep_gib`: host memory for captures each GPU's worker keeps once its
    captures are dropped, what a burst grew past it going back (arena.py `Arena.keep`; never less
    than `capture_memory_gib`); None: all of it, for the engine's life."""
    return None if gib is None else _gib_bytes("capture_memory_keep_gib", gib, "captures each GPU keeps when idle")


def _gib_bytes(name: str, gib, what: str) -> int:
    """Bytes of a setting given in GiB (None: 0); EngineError naming it unless a finite number >= 0."""
    if gib is None:
        return 0
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib >= 0 or gib == float("inf"):
        raise EngineError(f"{name}={gib!r}: give the GiB of host memory for {what}, a number >= 0")
    return int(gib * 2**30)


def prefix_rows(gib, plan: TapPlan, backend, data_parallel: int) -> int:
    """Bytes of `prefix_rows_gib`: host memory for captured rows of shared prompt blocks
    (tapc/worker/prefixrows.py), which lets captures of prompt rows read vLLM's prefix cache. Its
    scheduler and worker must share a process: one GPU, vLLM's single-process executor (its
    choice for one GPU; the worker checks it at load)."""
    rows = _gib_bytes("prefix_rows_gib", gib, "captured rows of shared prompt blocks")
    if not rows:
        return 0
    if plan.tensor_parallel_size * plan.pipeline_parallel_size * data_parallel > 1 or backend not in (None, "uni"):
        raise EngineError(f"prefix_rows_gib: the kept rows need vLLM's scheduler and tapc's worker in one process, "
                          f"which is one GPU with the single-process executor; this engine runs tensor_parallel_size="
                          f"{plan.tensor_parallel_size}, pipeline_parallel_size={plan.pipeline_parallel_size}, "
                          f"data_parallel_size={data_parallel}, distributed_executor_backend={backend!r} (on several "
                          "GPUs captures of prompt rows read no cached KV)")
    return rows


def _with_splits(plan: TapPlan, given) -> dict:
    """Graphs split at the plan's boundary ops as well as vLLM's own: a list of splitting ops
    replaces vLLM's defaults, so it names theirs too."""
    from vllm.config import CompilationConfig

    if given is not None and not isinstance(given, dict):
        raise EngineError("compilation_config: give it as a dict on engines with Python blocks (tapc adds "
                          "its splitting op to it)")
    config = dict(given or {})
    # vLLM's own splits with its KV-cache updates (tapc/vllm_surface.py checks they still exist)
    vllm_ops = [*CompilationConfig._attention_ops, "vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update"]
    ops = list(config.get("splitting_ops") or vllm_ops)
    config["splitting_ops"] = ops + [op for op in plan.splitting_ops if op not in ops]
    return config


def graph_code() -> list[Path]:
    """The files of GRAPH_MODULES and GRAPH_PACKAGES."""
    files = [Path(importlib.util.find_spec(name).origin) for name in GRAPH_MODULES]
    for name in GRAPH_PACKAGES:
        files += sorted(Path(importlib.util.find_spec(name).submodule_search_locations[0]).glob("*.py"))
    return files


def digest(plan: TapPlan) -> str:
    """The plan's digest and the source of everything that runs inside the graphs."""
    h = hashlib.sha256(plan.digest.encode())
    for path in graph_code():
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
