"""The tap ops, registered in the `tapc` namespace of `torch.library` on import.

Each op declares what it mutates and has a fake implementation that returns nothing, so that
Dynamo puts it in the graph as one node and Inductor calls it in place (no copy of the buffer
it writes). Nothing an op reads on the host changes between steps: shapes and strides are fixed
per captured graph, and the per-step tables are device tensors the host refills. So a CUDA
graph replays them correctly with whatever the tables hold at replay time.

`tapc::boundary` is different: the engine lists it in vLLM's splitting ops, so it runs eagerly
between graph pieces and calls back into tapc's runtime (see `set_boundary_handler`).

Registered through `torch.library.Library` rather than `torch.library.custom_op`: the same
schema and fake, but about a tenth of the dispatch cost per call, which counts in batches
that run the compiled graph without CUDA graphs (vLLM does the same for its own ops).
"""
import functools
from typing import Callable, Optional

import torch
import triton

from . import capture as _capture
from . import edit as _edit
from . import lens as _lens
from . import pattern as _pattern
from .common import runs_triton

# Kept alive for the life of the process: the ops are unregistered when it is collected.
_LIB = torch.library.Library("tapc", "DEF")

# The names of the Triton kernels the ops launch: how the engine knows a graph node is a tap's.
KERNELS = frozenset(v.__name__ for m in (_capture, _edit, _lens, _pattern) for v in vars(m).values()
                    if isinstance(v, triton.runtime.KernelInterface))

LaunchObserver = Callable[[tuple[torch.Tensor, ...]], None]
_launch_observer: Optional[LaunchObserver] = None


def set_launch_observer(fn: Optional[LaunchObserver]) -> None:
    """Call fn(tables) after each op's launch, `tables` the row tables the op read (its `dst` or
    `slot` arguments); None removes it. The engine sets one while vLLM captures its graphs, to
    learn which graph node each tap's kernel is (tapc/worker/switch.py)."""
    global _launch_observer
    _launch_observer = fn


# fn(table) -> True where an op whose row table is `table` may launch nothing this call: the
# engine's switch (tapc/worker/switch.py `Switch.idle`) in batches that run without CUDA graphs,
# where each op costs its Python call and a Triton launch. None: every op launches.
_idle: Optional[Callable[[torch.Tensor], bool]] = None


def _run(tables: tuple[torch.Tensor, ...], kernel: Callable, ref: Callable, x: torch.Tensor, *args) -> None:
    """One op's call: nothing where the switch says every one of its row tables is idle; else
    the Triton kernel (or, where Triton cannot run on x, the torch reference) on (x, *args),
    then the launch observer."""
    if _idle is not None and all(_idle(t) for t in tables):
        return
    (kernel if runs_triton(x) else ref)(x, *args)
    if _launch_observer is not None:
        _launch_observer(tables)


def _register(schema: str, impl: Callable) -> None:
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    # One Python implementation for every device; it picks Triton or the torch reference.
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    # The ops return nothing and only write their declared arguments: tracing needs no shapes.
    torch.library.register_fake(f"tapc::{name}", lambda *args, **kwargs: None, lib=_LIB)


def capture(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor, ring: Optional[torch.Tensor] = None,
            pos: Optional[torch.Tensor] = None, stride: int = 0) -> None:
    """out[dst[i]] = x[i].to(out.dtype) for rows i < x.shape[0] with dst[i] >= 0; with a ring
    (capture.py), dst[i] plus the row's phase times `stride`."""
    _run((dst,), _capture.capture, _capture.capture_ref, x, dst, out, ring, pos, stride)


def capture_pair(x0: torch.Tensor, x1: torch.Tensor, dst0: torch.Tensor, dst1: torch.Tensor,
                 out0: torch.Tensor, out1: torch.Tensor, ring: Optional[torch.Tensor] = None,
                 pos: Optional[torch.Tensor] = None, stride0: int = 0, stride1: int = 0) -> None:
    """Two captures (x0 -> out0 by dst0, x1 -> out1 by dst1) in one launch."""
    _run((dst0, dst1), _capture.capture_pair, _capture.capture_pair_ref, x0, x1, dst0, dst1, out0, out1,
         ring, pos, stride0, stride1)


def capture_trio(x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, dst0: torch.Tensor, dst1: torch.Tensor,
                 dst2: torch.Tensor, out0: torch.Tensor, out1: torch.Tensor, out2: torch.Tensor,
                 ring: Optional[torch.Tensor] = None, pos: Optional[torch.Tensor] = None, stride0: int = 0,
                 stride1: int = 0, stride2: int = 0) -> None:
    """Three captures (xk -> outk by dstk) in one launch."""
    _run((dst0, dst1, dst2), _capture.capture_trio, _capture.capture_trio_ref, x0, x1, x2, dst0, dst1, dst2,
         out0, out1, out2, ring, pos, stride0, stride1, stride2)


def capture_sum(a: torch.Tensor, b: torch.Tensor, dst: torch.Tensor, out: torch.Tensor,
                ring: Optional[torch.Tensor] = None, pos: Optional[torch.Tensor] = None, stride: int = 0) -> None:
    """out[dst[i]] = a[i] + b[i] (fp32 add, stored in out.dtype) for rows with dst[i] >= 0."""
    _run((dst,), _capture.capture_sum, _capture.capture_sum_ref, a, b, dst, out, ring, pos, stride)


def add_(x: torch.Tensor, b: Optional[torch.Tensor], slot: torch.Tensor, vec: torch.Tensor,
         alpha: torch.Tensor) -> None:
    """x[i] += alpha[slot[i]] * vec[slot[i]] for rows with slot[i] >= 0."""
    _run((slot,), _edit.add_, _edit.add_ref, x, b, slot, vec, alpha)


def scale_(x: torch.Tensor, b: Optional[torch.Tensor], slot: torch.Tensor,
           factor: torch.Tensor) -> None:
    """s = x (+ b) becomes factor[slot[i]] * s, written through x."""
    _run((slot,), _edit.scale_, _edit.scale_ref, x, b, slot, factor)


def set_cols_(x: torch.Tensor, b: Optional[torch.Tensor], slot: torch.Tensor, cols: torch.Tensor,
              vals: torch.Tensor) -> None:
    """s[cols[k, j]] = vals[k, j] with k = slot[i], entries cols >= 0; written through x."""
    _run((slot,), _edit.set_cols_, _edit.set_cols_ref, x, b, slot, cols, vals)


def project_out_(x: torch.Tensor, b: Optional[torch.Tensor], slot: torch.Tensor,
                 dirs: torch.Tensor) -> None:
    """s -= (s . d) d with d = dirs[slot[i]], dot in fp32; written through x."""
    _run((slot,), _edit.project_out_, _edit.project_out_ref, x, b, slot, dirs)


def patch_(x: torch.Tensor, b: Optional[torch.Tensor], slot: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
           at: torch.Tensor) -> None:
    """s = x (+ b) becomes rows[slot[i], j] where at[slot[i], j] == pos[i]; written through x."""
    _run((slot,), _edit.patch_, _edit.patch_ref, x, b, slot, pos, rows, at)


def lens(x: torch.Tensor, b: Optional[torch.Tensor], dst_ids: torch.Tensor, dst_logits: torch.Tensor,
         ids: torch.Tensor, logits: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
         cand_ids: torch.Tensor, cand_vals: torch.Tensor, eps: float, vocab: int, block_v: int,
         ring: Optional[torch.Tensor] = None, pos: Optional[torch.Tensor] = None, stride_ids: int = 0,
         stride_logits: int = 0) -> None:
    """The logit lens (lens.py): the top `k` token ids and logits of x (+ b) through the final
    norm and the unembedding, into ids[dst_ids[i]] and logits[dst_logits[i]]. Two launches, both
    observed, so the switch turns both graph nodes off on steps that ask for neither table."""
    tables = (dst_ids, dst_logits)
    # the first launch's node is noted between the two; `_run` notes the second's
    between = None if _launch_observer is None else lambda: _launch_observer(tables)
    _run(tables, functools.partial(_lens.lens, between=between), _lens.lens_ref, x, b, dst_ids, dst_logits, ids,
         logits, norm_weight, weight, cand_ids, cand_vals, eps, vocab, block_v, ring, pos, stride_ids, stride_logits)


def pattern(q: torch.Tensor, key_cache: torch.Tensor, dst: torch.Tensor, out: torch.Tensor, heads: torch.Tensor,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
            keys: int, ring: Optional[torch.Tensor] = None, pos: Optional[torch.Tensor] = None,
            stride: int = 0) -> None:
    """Attention patterns (pattern.py): each asked row's softmax weights over its request's keys.
    Not a `torch.ops.tapc` op: it runs inside vLLM's attention op, which the graphs call as one
    (tapc/worker/install.py `_Pattern`), so Dynamo never traces it."""
    _run((dst,), _pattern.pattern, _pattern.pattern_ref, q, key_cache, dst, out, heads, query_start_loc, seq_lens,
         block_table, scale, keys, ring, pos, stride)


BoundaryHandler = Callable[[int, torch.Tensor, Optional[torch.Tensor]], None]
_boundary_handler: Optional[BoundaryHandler] = None


def set_boundary_handler(fn: Optional[BoundaryHandler]) -> None:
    """Make `tapc::boundary` call fn(point, x, b); None removes the handler.

    fn must edit x (and b) in place and keep their addresses: the graph piece after the
    boundary reads the tensors it recorded at capture.
    """
    global _boundary_handler
    _boundary_handler = fn


def boundary(x: torch.Tensor, b: Optional[torch.Tensor], point: int) -> None:
    """Hand x (and b) to tapc's runtime at tap point `point`, a constant of the call site."""
    if _boundary_handler is None:
        raise RuntimeError(
            f"tapc::boundary reached tap point {point} but no boundary handler is set in this "
            "process; the engine must call tapc.kernels.ops.set_boundary_handler(fn) in every "
            "worker before the model runs"
        )
    _boundary_handler(point, x, b)


_RING = "Tensor? ring=None, Tensor? pos=None"
_register(f"capture(Tensor x, Tensor dst, Tensor(a!) out, {_RING}, int stride=0) -> ()", capture)
_register("capture_pair(Tensor x0, Tensor x1, Tensor dst0, Tensor dst1, Tensor(a!) out0, Tensor(b!) out1, "
          f"{_RING}, int stride0=0, int stride1=0) -> ()", capture_pair)
_register("capture_trio(Tensor x0, Tensor x1, Tensor x2, Tensor dst0, Tensor dst1, Tensor dst2, Tensor(a!) out0, "
          f"Tensor(b!) out1, Tensor(c!) out2, {_RING}, int stride0=0, int stride1=0, int stride2=0) -> ()",
          capture_trio)
_register(f"capture_sum(Tensor a, Tensor b, Tensor dst, Tensor(a!) out, {_RING}, int stride=0) -> ()", capture_sum)
_register("add_(Tensor(a!) x, Tensor? b, Tensor slot, Tensor vec, Tensor alpha) -> ()", add_)
_register("scale_(Tensor(a!) x, Tensor? b, Tensor slot, Tensor factor) -> ()", scale_)
_register("set_cols_(Tensor(a!) x, Tensor? b, Tensor slot, Tensor cols, Tensor vals) -> ()",
          set_cols_)
_register("project_out_(Tensor(a!) x, Tensor? b, Tensor slot, Tensor dirs) -> ()", project_out_)
_register("patch_(Tensor(a!) x, Tensor? b, Tensor slot, Tensor pos, Tensor rows, Tensor at) -> ()", patch_)
_register("lens(Tensor x, Tensor? b, Tensor dst_ids, Tensor dst_logits, Tensor(a!) ids, Tensor(b!) logits, "
          "Tensor norm_weight, Tensor weight, Tensor(c!) cand_ids, Tensor(d!) cand_vals, float eps, int vocab, "
          f"int block_v, {_RING}, int stride_ids=0, int stride_logits=0) -> ()", lens)
_register("boundary(Tensor(a!) x, Tensor(b!)? b, int point) -> ()", boundary)
