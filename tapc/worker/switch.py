"""Tap kernels switched off inside the captured CUDA graphs on steps that ask nothing of them.

A tap kernel that no row of a step asks for still runs when its graph is replayed: it reads
its row table, finds -1 and returns. That is about 1 us of GPU time a node whatever the batch:
72 nodes, 3.6% of a decode step at batch 1 on the MoE shape (benchmarks/results/findings-engine.md). The CUDA
driver can disable a kernel node of an instantiated graph between launches
(`cuGraphNodeSetEnabled`: the node is an empty node until enabled again; the calls are in
cugraph.py), so:

- while vLLM captures its graphs (`capture_model`, patches.py), its `torch.cuda.CUDAGraph` is
  `SwitchedGraph`, which keeps its CUDA graph after instantiation (the node handles belong to
  it), and each tap op, right after its launch, hands over the row tables it reads
  (tapc/kernels/ops.py `set_launch_observer`): the graph under capture notes the node that launch
  made (the capture stream's last node, checked to be one of tapc's kernels by name) and the
  taps (table rows) it serves;
- once captured, a graph with tap nodes also gets a copy of itself without them (`bare`:
  cloned, the tap nodes taken out and their neighbours joined, instantiated);
- before each forward the hooks say which taps the step's requests ask for (`Switch.want`, a
  bitmask over the table rows: the step's `taps`, as the step tables hand it on, tables.py). A
  graph, when replayed, launches its bare copy where the step asks for no tap; otherwise it
  enables the nodes of the taps asked for and disables the others, calling the driver only
  for nodes whose state changes (none while the steps ask for the same taps). A disabled node
  is an empty node, which still costs the graph about half of what the kernel did
  (benchmarks/probes/probe_nodes.py); the bare copy costs nothing a step but a graph's
  instantiation at start.

A node is only off where no request of the step asks for its tap: its table owns no row then,
and the kernel would have done nothing. Graphs broken by Python blocks (graphs.py) are not
switched. Where the driver lacks these calls (older than CUDA 12.3), graphs are not switched.

Batches larger than vLLM's largest graph run the compiled forward without CUDA graphs, where
each tap op is a Python call and a Triton launch (about 50 us of the engine's thread, 33 a step
for a plan on every layer of an 8B model). There the op asks the switch first (`idle`, tapc/kernels/ops.py)
and launches nothing for a tap the step does not ask for. TAPC_SWITCH_GRAPHS=0 in the engine's
environment turns both off: every tap kernel runs at every replay and every launch.
"""
from __future__ import annotations

import logging

import torch

from tapc.errors import EngineError
from tapc.kernels import ops
from tapc.worker.component import Step, StepComponent
from tapc.worker.cugraph import Driver
from tapc.worker.patches import Patch, capture_patch

log = logging.getLogger("tapc")

ALL = -1                     # every tap: as a graph is captured, and where no step said otherwise


class Switch(StepComponent):
    """One worker's switch: which taps the next replay runs, and how a tap op's tables map to
    taps (`table`: Buffers.table, `[taps, rows]` int32, a tap's tables are views into its row).
    Without a driver (the CPU stand-in) it only holds what the hooks want. As a step component
    it takes each step's want from the step (`Step.taps`, as the step tables hand it on), so it
    comes after them in the step loop (assemble.py); a switch outside the loop has its `want`
    set by hand."""

    def __init__(self, driver: Driver | None, table: torch.Tensor, kernels: frozenset[str]):
        self.driver = driver
        self.kernels = kernels
        self.want = ALL
        # Whether the forward under way is a step's (the hooks filled its tables), not a dummy run:
        # a dummy run launches every op, so that Triton builds each kernel before any graph capture.
        self.stepping = False
        self._base = table.data_ptr()
        self._row_bytes = table.stride(0) * table.element_size()
        self._end = self._base + table.shape[0] * self._row_bytes

    def patches(self, runner) -> list[Patch]:
        """Tap ops outside graphs ask `idle` before they launch; with a driver, the runner's
        graphs are captured as `SwitchedGraph`s, the ops' launches telling them their tap nodes."""
        made = [Patch(ops, "_idle", self.idle)]
        if self.driver is not None:
            made.append(capture_patch(runner, SwitchedGraph.bound(self), Patch(ops, "_launch_observer", self.observe)))
        return made

    def begin_step(self, step: Step) -> None:
        self.want = step.taps
        self.stepping = True

    def reset(self) -> None:
        self.want = 0
        self.stepping = False

    def taps_of(self, tables) -> int:
        """The bitmask of the taps whose rows of `table` these tensors start in (0 for others)."""
        mask = 0
        for t in tables:
            mask |= self._bit(t)
        return mask

    def _bit(self, t: torch.Tensor) -> int:
        """The bit of the tap whose row of `table` `t` starts in; 0 for any other tensor."""
        ptr = t.data_ptr()
        return 1 << ((ptr - self._base) // self._row_bytes) if self._base <= ptr < self._end else 0

    def idle(self, table: torch.Tensor) -> bool:
        """Whether a tap op outside a graph may launch nothing (tapc/kernels/ops.py): in a step whose
        requests ask nothing of the tap whose row `table` is (every entry -1: the kernel would do
        nothing), and not under a graph capture, whose graph would lack the node for good."""
        if not self.stepping:
            return False
        bit = self._bit(table)
        if not bit or self.want & bit:
            return False
        return not (table.is_cuda and torch.cuda.is_current_stream_capturing())

    def observe(self, tables) -> None:
        """A tap op's launch (tapc/kernels/ops.py's launch observer): under a SwitchedGraph's capture,
        its node and taps are noted."""
        graph = SwitchedGraph.capturing
        if graph is None or graph.switch is not self:
            return
        found = self.driver.last_node(torch.cuda.current_stream().cuda_stream)
        taps = self.taps_of(tables)
        # Only a node of tapc's own kernels: an op that launched nothing (no rows) leaves the
        # model's last kernel there, which must never be switched.
        if found is not None and taps and self.driver.kernel_name(found[1]) in self.kernels:
            graph.note(*found, taps)


class SwitchedGraph(torch.cuda.CUDAGraph):
    """vLLM's `torch.cuda.CUDAGraph` while it captures (patches.py): the same graph, whose tap
    kernel nodes `replay` turns on and off as the switch says."""

    switch: Switch | None = None                   # set on the subclass the worker makes
    capturing: "SwitchedGraph | None" = None       # the graph under capture (one at a time)

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls, True)

    def __init__(self, *args, **kwargs):
        super().__init__(keep_graph=True)   # node handles belong to the graph: keep it
        self.device = torch.cuda.current_device()   # where it is captured and replayed
        self.nodes: dict[int, int] = {}           # node -> the taps it serves
        self._graph = None                        # the CUDA graph the nodes were noted in
        self._state = ALL                         # the want its nodes are set for
        self.bare = None                          # the graph without its tap nodes, instantiated

    @classmethod
    def bound(cls, switch: Switch) -> type["SwitchedGraph"]:
        return type(cls.__name__, (cls,), {"switch": switch})

    def capture_begin(self, *args, **kwargs) -> None:
        super().capture_begin(*args, **kwargs)
        SwitchedGraph.capturing = self

    def capture_end(self) -> None:
        SwitchedGraph.capturing = None
        super().capture_end()
        if self.nodes and self.raw_cuda_graph() != self._graph:
            log.warning("tapc: a captured graph is not the one its tap nodes were noted in; it is not switched")
            self.nodes = {}
        self.instantiate()
        if self.nodes:
            try:
                self.bare = self.switch.driver.without(self._graph, self.nodes)
            except EngineError as e:   # the graph still switches its nodes one by one
                log.warning("tapc: no copy of a graph without its tap kernels: %s", e)

    def note(self, graph: int, node: int, taps: int) -> None:
        # A node seen before is an earlier op's, met again after an op that launched nothing.
        if self._graph not in (None, graph) or node in self.nodes:
            return
        self._graph = graph
        self.nodes[node] = taps

    def replay(self) -> None:
        want = self.switch.want
        if want == 0 and self.bare is not None:
            # The same kernels on the same memory, less the taps': launched as torch launches
            # its graph (vLLM's graphs draw no random numbers, whose offsets torch would advance),
            # on the current stream's raw handle (as Inductor's code reads it: a Stream object
            # costs more than the launch, and a piecewise step makes 30-odd of these).
            self.switch.driver.launch(self.bare, torch._C._cuda_getCurrentRawStream(self.device))
            return
        if want != self._state and self.nodes:
            self._set(want)
        super().replay()

    def __del__(self):
        bare, self.bare = getattr(self, "bare", None), None
        if bare is not None:
            self.switch.driver.destroy(bare)

    def _set(self, want: int) -> None:
        exec_, driver = self.raw_cuda_graph_exec(), self.switch.driver
        for node, taps in self.nodes.items():
            on = bool(taps & want)
            if on != bool(taps & self._state):
                err = driver.set_enabled(exec_, node, on)
                if err != 0:
                    self._give_up(err)
                    return
        self._state = want

    def _give_up(self, err: int) -> None:
        """Every node on again and no more switching: a node left off could capture nothing."""
        exec_, driver = self.raw_cuda_graph_exec(), self.switch.driver
        for node in self.nodes:
            again = driver.set_enabled(exec_, node, True)
            if again != 0:
                raise EngineError(f"tapc could not turn a tap kernel of a CUDA graph back on (CUresult {again})")
        log.warning("tapc: cuGraphNodeSetEnabled failed (CUresult %d); this graph's tap kernels stay on", err)
        self.nodes = {}
        self._state = ALL
