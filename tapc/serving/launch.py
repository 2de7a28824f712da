"""`tapc serve`: vLLM's OpenAI-compatible server with a tap plan.

    tapc serve spec.yaml [vllm serve options...]
    tapc serve --model M --tap "model.layers.*.resid" --tap "model.layers.10.resid | add(steer)" [options...]

builds the plan (as `VLLM(...)` does, no GPU needed), then runs `vllm serve MODEL` with the
engine arguments the plan needs (tapc's worker class, the engine's config in
`--additional-config '{"tapc": {...}}'`, batch sizes, splitting ops: tapc/api/engine.py), the
spec's own engine arguments, then the options given here (vLLM parses them; a clash with what
the plan needs is refused by it, e.g. another --max-num-seqs). `VLLM_PLUGINS` gets `tapc`, so
vLLM loads tapc's endpoint plugin (http.py); where tapc is not installed (a source checkout on
PYTHONPATH), a small `.dist-info` folder declaring that entry point goes on PYTHONPATH, so
vLLM's entry-point discovery finds it the same way.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

from tapc.errors import TapcError

ENTRY = "tapc = tapc.serving.http:TapcEndpoints"


def serve_argv(model: str, taps: list[str], *, capture_dtype: str | None = None, spec_path: str | None = None,
               engine: dict | None = None, extra: list[str] = (), blocks: dict[str, str] | None = None,
               save: dict | None = None, functions: dict[str, str] | None = None) -> list[str]:
    """`vllm serve`'s arguments (after the program name) for this plan. `blocks`: the plan's
    Python blocks by import path ('package.module:function'); each worker imports them.
    `functions`: its compiled functions by import path, traced here and pickled for the workers. `save`:
    the save folder's settings (saving.py: `folder`, `shard_tokens`, `positions`)."""
    if "--enable-expert-parallel" in extra or "-ep" in extra:   # vLLM's own flag, past engine_kwargs
        from tapc.api.engine_args import refuse_expert_parallel

        refuse_expert_parallel()
    from tapc.api.engine import Engine
    from tapc.api.session import plan_blocks
    from tapc.lang.blockpaths import import_blocks

    functions = import_blocks(functions or {}, "tapc serve", what="function")
    # the server loads the spec's parameter values from its file, and its workers import the blocks
    served, args = Engine.build(model, taps, dict(engine or {}), capture_dtype=capture_dtype, functions=functions,
                                spec=None if spec_path is None else os.path.abspath(spec_path), blocks=dict(blocks or {}),
                                save={**save, "folder": os.path.abspath(save["folder"])} if save else None)
    if blocks:
        # here first, so that a name the plan lacks or a path that does not import is said
        # before vLLM starts (the server's Python is this one)
        plan_blocks(served.plan, import_blocks(blocks, "tapc serve"))
    if save:
        from tapc.harvest.run import harvest_keys

        harvest_keys(served.plan)   # a plan with nothing to save is said now, not at the server's start
    return ["serve", model, *flags(args), *extra]


# vLLM options `tapc serve` takes into the engine's arguments rather than past them: the plan is
# sized for the first six, and engine_kwargs checks the executor against the plan's sizes.
TAKEN = {"--max-num-seqs": ("max_num_seqs", int), "--max-num-batched-tokens": ("max_num_batched_tokens", int),
         "--tensor-parallel-size": ("tensor_parallel_size", int), "-tp": ("tensor_parallel_size", int),
         "--pipeline-parallel-size": ("pipeline_parallel_size", int), "-pp": ("pipeline_parallel_size", int),
         "--distributed-executor-backend": ("distributed_executor_backend", str)}


def sizes(rest: list[str]) -> tuple[dict, list[str]]:
    """(engine arguments of TAKEN, the other options) of `vllm serve` options (`--opt V` or `--opt=V`)."""
    engine, out, i = {}, [], 0
    while i < len(rest):
        opt, eq, value = rest[i].partition("=")
        if opt in TAKEN:
            if not eq:
                i += 1
                value = rest[i] if i < len(rest) else ""
            name, kind = TAKEN[opt]
            if not value:
                raise TapcError(f"tapc serve: {opt} needs a value")
            try:
                engine[name] = kind(value)
            except ValueError:
                raise TapcError(f"tapc serve: {opt} takes a number, got {value!r}") from None
        else:
            out.append(rest[i])
        i += 1
    return engine, out


def flags(kwargs: dict) -> list[str]:
    """Engine keyword arguments as `vllm serve` options (dicts and lists as JSON)."""
    out = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (dict, list, tuple)):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def serve_env(env: dict) -> dict:
    """The environment `vllm serve` needs for tapc's endpoint plugin."""
    from importlib.metadata import entry_points

    env = dict(env)
    allowed = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
    if "VLLM_PLUGINS" not in env:   # keep the general plugins vLLM would load without an allowlist
        allowed = [p.name for p in entry_points(group="vllm.general_plugins")]
    env["VLLM_PLUGINS"] = ",".join(dict.fromkeys([*allowed, "tapc"]))
    if not any(p.name == "tapc" for p in entry_points(group="vllm.endpoint_plugins")):
        here = tempfile.mkdtemp(prefix="tapc-plugin-")
        info = os.path.join(here, "tapc_serve_plugin-0.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: tapc-serve-plugin\nVersion: 0\n")
        with open(os.path.join(info, "entry_points.txt"), "w") as f:
            f.write(f"[vllm.endpoint_plugins]\n{ENTRY}\n")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def run(argv: list[str]) -> None:
    """Replace this process with `vllm serve` (the argv of `serve_argv`)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", *argv]
    os.execve(sys.executable, cmd, serve_env(dict(os.environ)))
