"""The vLLM worker of a tapped engine: vLLM's GPU worker plus the taps, installed at load.

`api.engine_args.engine_kwargs` names this class as `worker_cls` and puts the engine's
`EngineConfig` (tapc/wire/config.py), the plan in it, in `additional_config["tapc"]`, so it
reaches every worker process (the engine core runs in a child process by default) and is part
of vLLM's compile-cache key. `load_model`
runs before vLLM's first forward (memory profiling, where torch.compile traces), which is when
the taps must be in place.

Under tensor / pipeline parallelism vLLM's multiprocessing executor runs one worker per GPU,
each with the whole plan: it installs its own GPU's part (layout.py, tapc/plan/ranks.py), fills
its tables from the same scheduler output as the others, writes its captures into its own
arena, and answers `tapc_collect` for itself (the API merges the answers, session.py).

The `tapc_*` methods are the RPCs the API sends (vLLM's `collective_rpc`): the step loop's own
(`RunnerHooks`), the worker's readings of what it built, and those a step component declares
(`StepComponent.rpcs`), passed on to it through `RunnerHooks.rpc`.
"""
from __future__ import annotations

import importlib.util
import pickle

import torch
from vllm.v1.worker.gpu_worker import Worker

from tapc import settings
from tapc.errors import EngineError
from tapc.plan.tapplan import TapPlan
from tapc.wire.config import EngineConfig
from tapc.wire.node import shm_identity
from tapc.worker.assemble import Process, assemble
from tapc.worker.buffers import Buffers
from tapc.worker.copyout import CopyOut
from tapc.worker.cugraph import Driver
from tapc.worker.graphs import SegmentedGraph
from tapc.worker.layout import Layout
from tapc.worker.runner_v2 import V2Adapter
from tapc.worker.switch import SwitchedGraph

# The runners the installed vLLM has: 0.26 runs MoE, hybrid and pooling models on its V1 runner;
# 0.34 has no V1 runner (V2 runs every model), so V1's adapter is neither imported nor offered.
if importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None:
    from tapc.worker.runner_v1 import V1Adapter

    ADAPTERS: tuple[type, ...] = (V2Adapter, V1Adapter)
else:
    ADAPTERS = (V2Adapter,)


class TapWorker(Worker):
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        config = EngineConfig.read(self.vllm_config.additional_config)
        if config is None:
            raise EngineError("tapc's worker runs without a plan: build engines with tapc.VLLM(...)")
        plan = TapPlan.from_json(config.plan)
        runner = self.model_runner
        adapter_cls = runner_adapter(runner)
        tp_rank, stage = _place(plan)
        layout = Layout(plan, tp_rank, stage)
        sched = self.vllm_config.scheduler_config
        before = torch.cuda.memory_allocated(self.device)
        buffers = Buffers(layout, runner.max_num_tokens, sched.max_num_seqs, self.vllm_config.max_concurrent_batches,
                          self.device)
        copy_out = CopyOut(layout, buffers.pools, runner.max_num_tokens, sched.max_num_seqs, self.device)
        # What tapc took from the GPU, against what `tapc explain` said (tests/plan/test_sizing_gpu.py).
        self.tapc_allocated = torch.cuda.memory_allocated(self.device) - before
        self.tapc_has_blocks = any(t.action == "block" for t in plan.taps)
        if config.prefix_rows:
            backend = self.vllm_config.parallel_config.distributed_executor_backend
            if backend != "uni":   # the scheduler, whose lookup the rows limit, runs in another process
                raise EngineError(f"prefix_rows_gib: this engine runs vLLM's {backend!r} executor; the kept rows "
                                  "need its single-process one (\"uni\"), one GPU")
        process = Process(runner, adapter_cls, buffers, copy_out, _functions(config.functions), _on_api_node,
                          self.vllm_config.cache_config.block_size, settings.TAPC_SWITCH_GRAPHS,
                          driver=Driver.load,
                          register=_register, unregister=_unregister, all_gather=_tp_all_gather)
        self.tapc_process = process   # its device memory, which `tapc_memory` reads
        self.tapc, self.tapc_adapter, self.tapc_patches = assemble(layout, config, process)

    def tapc_collect(self, ids: list[str], release: list[tuple[str, int]] = ()) -> dict:
        """The results of these tapc ids, as a `protocol.CollectReply` in wire form, after giving
        back the chunks in `release` (one round trip for both)."""
        return self.tapc.collect(ids, release).to_wire()

    def tapc_count_nonfinite(self, on: bool) -> None:
        """Count the NaN / inf values of the captures as they are copied out (a harvest's
        check), from 0, or stop; collect replies carry the count (tables.py)."""
        self.tapc.rpc("tapc_count_nonfinite")(on)

    def tapc_release(self, chunks: list[tuple[str, int]]) -> None:
        self.tapc.release(chunks)

    def tapc_close(self) -> None:
        """The engine stops (`VLLM.close`): the arena's files go now, not when the process exits;
        the caller's tensors over them keep their memory."""
        self.tapc.arena.close()

    def tapc_held(self) -> dict[str, int]:
        """What requests hold on this worker now (`RunnerHooks.held`): all 0 on an idle engine
        whose callers dropped their captures, aborted requests included."""
        return self.tapc.held()

    def tapc_host_time(self) -> dict[str, float]:
        """The host time tapc's hooks took on this worker's engine thread (`RunnerHooks.host_time`)."""
        return self.tapc.host_time()

    def tapc_memory(self) -> dict[str, int | float]:
        """tapc's device buffers: `owned`, the bytes of their tensors; `tensors`, how many;
        `allocated`, what the allocator handed out while they were made. Host memory for
        captures: `host`, the arena's bytes (pinned), and `host_growth_s`, the seconds spent
        making and pinning them."""
        tensors = self.tapc_process.buffers.tensors() + self.tapc_process.copy_out.tensors()
        arena = self.tapc.arena
        return {"owned": sum(t.nbytes for t in tensors), "tensors": len(tensors), "allocated": self.tapc_allocated,
                "host": arena.size, "host_growth_s": arena.growth_s}

    def tapc_graph_breaks(self) -> list[tuple[int, int]]:
        """(tokens, blocks it replays between its segments) of each FULL graph the runner
        captured: what `tapc explain` promises, as the engine built it."""
        graphs = self.tapc_adapter.graphs()
        return sorted((d.num_tokens, len(g.steps) if isinstance(g, SegmentedGraph) else 0) for d, g in graphs.items())

    def tapc_switched(self) -> list[tuple[int, int, bool]]:
        """(tokens, tap kernel nodes it switches, whether it has a copy without them) of each
        FULL graph the runner captured: (tokens, 0, False) where nothing is switched (blocks,
        or a driver without the calls)."""
        graphs = self.tapc_adapter.graphs()
        return sorted((d.num_tokens, len(g.nodes), g.bare is not None) if isinstance(g, SwitchedGraph)
                      else (d.num_tokens, 0, False) for d, g in graphs.items())

    def tapc_set_blocks(self, blocks: bytes) -> None:
        """Engine-wide Python blocks, by name (cloudpickled by the API). Every worker gets them;
        one whose GPU runs none of the plan's blocks (another pipeline stage's) keeps none (points.py)."""
        register = self.tapc.rpc("tapc_set_blocks")
        if register is None:
            if not self.tapc_has_blocks:
                raise EngineError("this engine's plan has no Python blocks")
            return
        register(blocks)


def runner_adapter(runner):
    """The adapter class for vLLM's model runner, of those in `ADAPTERS` (vLLM 0.26: V2 for dense
    models, V1 for MoE, hybrid and pooling models or under VLLM_USE_V2_MODEL_RUNNER=0); any other
    runner is refused before anything is allocated."""
    for adapter in ADAPTERS:
        if adapter.matches(runner):
            return adapter
    runners = " and ".join(adapter.RUNNER for adapter in ADAPTERS)
    raise EngineError(f"tapc instruments vLLM's {runners} model runner{'s' if len(ADAPTERS) > 1 else ''}, but "
                      f"this engine runs {type(runner).__module__}.{type(runner).__name__}")


def _functions(path: str | None) -> dict:
    """The plan's compiled functions, which the API pickled by value into `path`, each on its own
    (api/engine.py `ship_functions`)."""
    if path is None:
        return {}
    with open(path, "rb") as f:
        return {name: pickle.loads(data) for name, data in pickle.load(f).items()}


def _place(plan: TapPlan) -> tuple[int, int]:
    """(tensor-parallel rank, pipeline stage) of this worker, checked against the plan: the
    sizes it was built for, and the layers vLLM gave this stage (VLLM_PP_LAYER_PARTITION is
    read by each process; the plan recorded what the API saw)."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.distributed.utils import get_pp_indices

    tp, pp = get_tensor_model_parallel_world_size(), get_pp_group().world_size
    if (tp, pp) != (plan.tensor_parallel_size, plan.pipeline_parallel_size):
        raise EngineError(f"this engine runs tensor_parallel_size={tp}, pipeline_parallel_size={pp}, but the plan was "
                          f"built for {plan.tensor_parallel_size} and {plan.pipeline_parallel_size}")
    stage = get_pp_group().rank_in_group
    if plan.pp_layers:
        layers = get_pp_indices(plan.num_layers, stage, pp)
        if tuple(layers) != tuple(plan.pp_layers[stage]):
            raise EngineError(f"pipeline stage {stage} holds decoder layers {layers[0]}..{layers[1] - 1}, but the plan "
                              f"put {plan.pp_layers[stage][0]}..{plan.pp_layers[stage][1] - 1} there: "
                              "VLLM_PP_LAYER_PARTITION differs between the API's process and the workers'")
    return get_tensor_model_parallel_rank(), stage


def _on_api_node(api_shm: str | None) -> bool:
    """Whether this worker shares tapc's shared-memory folder with the API: the API's identity
    of it (`api_shm`, tapc/wire/node.py) is this process's (one it cannot read: no, its rows are
    sent). Where the API could not read its own (every worker gets the same config): whether it
    shares a node with global rank 0, the API's node under vLLM's multiprocessing executor
    (`in_the_same_node_as`, a collective: every worker calls it at load)."""
    if api_shm is not None:
        return shm_identity() == api_shm
    from vllm.distributed.parallel_state import get_world_group, in_the_same_node_as

    world = get_world_group()
    if world.world_size == 1:
        return True
    return in_the_same_node_as(world.cpu_group, source_rank=0)[world.rank_in_group]


def _tp_all_gather(t: torch.Tensor) -> torch.Tensor:
    """The tensor-parallel group's all-gather on the last dim (blocks at sharded points)."""
    from vllm.distributed import get_tp_group

    return get_tp_group().all_gather(t, dim=-1)


def _register(t: torch.Tensor) -> None:
    """Pin an arena file's mapping once, so the side stream's copies into it are asynchronous
    DMA (a copy to pageable memory would block the host)."""
    _cuda_check(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0), "cudaHostRegister", t)


def _unregister(t: torch.Tensor) -> None:
    """Unpin a mapping `_register` pinned, before the arena frees its pages (`Arena._drop`)."""
    _cuda_check(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()), "cudaHostUnregister", t)


def _cuda_check(err, call: str, t: torch.Tensor) -> None:
    if int(err) != 0:
        raise EngineError(f"{call} of {t.numel() / 2**30:.2f} GiB of capture memory failed: error {int(err)}")
