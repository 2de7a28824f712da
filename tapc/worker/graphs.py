"""FULL CUDA graphs that Python blocks break: graph, block, graph, at every replay.

vLLM captures a FULL graph per decode batch size with one `torch.cuda.graph` around the whole
forward: attention included, no Python at replay. A `tapc::boundary` met during that capture
would run once and be baked in. While the runner captures (patches.py `capture_patch`),
`torch.cuda.CUDAGraph` is `SegmentedGraph`: a CUDA graph that a boundary ends, runs the block
eagerly, and continues in a new graph on the same memory pool, recording the block for replay.
vLLM keeps the object as its graph and calls `replay()`, which runs the segments and the
blocks in order on the current stream. Attention stays inside the segments, so a decode step
with one block is two graph replays and one Python call instead of PIECEWISE's one graph piece
per layer with attention run eagerly between them (docs/blocks.md, Cost).

The same idea as vLLM 0.26's `BreakableCUDAGraphCapture` (vllm/compilation/breakable_cudagraph.py),
which breaks at attention instead; this one breaks only at tapc's op and plugs in where vLLM
makes its graphs, so vLLM's own capture and dispatch (sizes, pools, FULL vs PIECEWISE) stay.
Graphs made during the capture that no boundary breaks (PIECEWISE pieces: the boundary is a
splitting op, outside them) are plain CUDA graphs with an empty step list.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

_CUDAGraph = torch.cuda.CUDAGraph    # the class itself, while `torch.cuda.CUDAGraph` is patched


class SegmentedGraph(_CUDAGraph):
    capturing: "SegmentedGraph | None" = None   # the graph under capture (one at a time per process)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[Callable[[], None], torch.cuda.CUDAGraph]] = []   # (block, next segment)
        self._segment: torch.cuda.CUDAGraph = self
        self._error_mode = "global"

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        self._error_mode = capture_error_mode
        SegmentedGraph.capturing = self

    def capture_end(self) -> None:
        SegmentedGraph.capturing = None
        self._end_segment()

    def _end_segment(self) -> None:
        if self._segment is self:
            super().capture_end()
        else:
            self._segment.capture_end()

    def break_here(self, block: Callable[[], None]) -> None:
        """End the segment under capture, run `block` (eagerly, on the capture stream), and go on
        in a new segment that shares this graph's memory pool: the next segment reads the
        activations the last one wrote, at the addresses it wrote them."""
        self._end_segment()
        block()
        nxt = _CUDAGraph()
        nxt.capture_begin(pool=self.pool(), capture_error_mode=self._error_mode)
        self.steps.append((block, nxt))
        self._segment = nxt

    def replay(self) -> None:
        super().replay()
        for block, segment in self.steps:
            block()
            segment.replay()


def breaking(handler: Callable[[int, torch.Tensor, "torch.Tensor | None"], None]):
    """The boundary handler for `set_boundary_handler`: `handler` itself, except during a
    `SegmentedGraph` capture, where the call becomes a break in that graph. The block keeps
    weak references to x and b: the graph pool owns their memory (a strong one would pin it
    across the capture of every batch size, as vLLM notes for its own breaks)."""
    from vllm.utils.torch_utils import weak_ref_tensor

    @functools.wraps(handler)
    def boundary(point: int, x: torch.Tensor, b: torch.Tensor | None) -> None:
        graph = SegmentedGraph.capturing
        if graph is None:
            handler(point, x, b)
            return
        xw, bw = weak_ref_tensor(x), None if b is None else weak_ref_tensor(b)
        graph.break_here(lambda: handler(point, xw, bw))

    return boundary
