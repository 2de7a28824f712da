"""The one wiring of a worker's step loop: the taps installed in the model, the step components
(component.py) picked and built from this GPU's part of the plan (`Layout`) and the engine's
config (tapc/wire/config.py), the runner's step routed through its adapter, and the patches
the components declare applied (patches.py).

`TapWorker.load_model` (worker.py) and the CPU toy engine (tests/support/engine_toy.py `hooks_for`) both
call `assemble`. What only the process knows comes in a `Process` (the runner, device memory,
pinning, the driver), so the toy differs from a GPU worker in those inputs only, never in how
the parts are put together: the CPU tests check the wiring the GPU runs.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from tapc.kernels import ops
from tapc.lang.blockpaths import import_blocks
from tapc.wire.arena import SEGMENT_BYTES, Arena
from tapc.wire.config import EngineConfig
from tapc.worker import patches
from tapc.worker.buffers import Buffers
from tapc.worker.cugraph import Driver
from tapc.worker.install import install
from tapc.worker.layout import Layout
from tapc.worker.points import EnginePoints
from tapc.worker.prefixrows import PrefixRows
from tapc.worker.runner import RunnerHooks
from tapc.worker.slots import EditSlots
from tapc.worker.switch import Switch
from tapc.worker.tables import StepTables


@dataclass(frozen=True)
class Process:
    """What only the worker's process knows, as it hands it to `assemble`."""

    runner: object                      # vLLM's model runner (V2 or V1)
    adapter: type                       # its adapter class (runner_v2.V2Adapter, runner_v1.V1Adapter)
    buffers: Buffers                    # the device tables and pools, in this process's device memory
    copy_out: object                    # the captured rows' way to host memory (copyout.CopyOut)
    functions: Mapping                  # the plan's compiled functions, by name (from config.functions)
    on_api_node: Callable[[str | None], bool]   # whether it shares the API's shared memory (config.api_shm)
    cache_block: int                    # tokens a block of vLLM's KV cache (kept prefix rows)
    switching: bool                     # tap kernels off where no row asks (settings.TAPC_SWITCH_GRAPHS)
    driver: Callable[[], Driver | None] = lambda: None   # loads the driver calls that switch graph nodes
    register: Callable | None = None    # pins an arena file's mapping (None: plain memory)
    unregister: Callable | None = None  # unpins it before the arena frees it
    segment_bytes: int = SEGMENT_BYTES  # the arena's smallest file
    all_gather: Callable | None = None  # the tensor-parallel all-gather on the last dim (points.py)
    kv_manager: type | None = None      # the scheduler's KV cache manager class (None: vLLM's)
    compiled: bool = True               # the compiled fill (False: numpy's, fill.py)


class Assembly(NamedTuple):
    """A worker's step loop, as `assemble` built it."""

    hooks: RunnerHooks
    adapter: object       # the runner adapter, whose methods the runner's step calls
    patches: patches.Patches


def assemble(layout: Layout, config: EngineConfig, process: Process) -> Assembly:
    """Install the taps in the runner's model, build the step components the plan and config
    ask for, and route the runner's step through them."""
    runner, buffers = process.runner, process.buffers
    # the ops read the runner's positions only where rings are on (rings.py)
    positions = process.adapter.positions(runner)
    buffers.positions = positions if config.rings else None
    install(runner.get_model(), layout, buffers, dict(process.functions), positions)
    points = EnginePoints(layout, buffers, process.all_gather) if layout.blocks or layout.engine else None
    if points is not None and config.blocks:   # a server's blocks, by import path (tapc serve)
        points.runtime.register(import_blocks(config.blocks, "the engine's plan"))
    arena = Arena(register=process.register, unregister=process.unregister, keep=config.capture_keep,
                  segment_bytes=process.segment_bytes)
    arena.reserve(config.capture_memory)   # capture_memory_gib: pinned now, not on a step's path
    rows = PrefixRows(layout, process.cache_block, config.prefix_rows, process.kv_manager) \
        if config.prefix_rows else None
    tables = StepTables(layout, buffers, process.copy_out, arena, compiled=process.compiled,
                        inline=not process.on_api_node(config.api_shm))
    # Graphs broken by blocks are not switched (switch.py), nor where the user said not to;
    # where the driver cannot (or the process has none), only the launches outside graphs are.
    switch = Switch(process.driver(), buffers.table, ops.KERNELS) if not layout.blocks and process.switching else None
    # in the loop's order: the switch reads the taps the step tables hand on (component.py)
    components = [c for c in (tables, EditSlots(buffers), rows, switch, points) if c is not None]
    hooks = RunnerHooks(layout, arena, components)
    adapter = process.adapter(runner, hooks)
    return Assembly(hooks, adapter, patches.apply(runner, adapter, components))
