"""Python blocks at graph boundaries: per-request views, contexts, saved values, error capture.

A tap `point -> name` puts `torch.ops.tapc.boundary(x, b, k)` at the point; vLLM's piecewise
backend splits the graph there, so the op runs eagerly at every replay and calls
`BlockRuntime.__call__(k, x, b)`. Before each forward the runner tells the runtime which rows
of the step's slab belong to which request (`begin_step`); the runtime then calls each
request's block on a view of only its rows:

    def probe(ctx, x):            # x: [rows of this request in this step, width], on the GPU
        ctx.save("norm", x.norm(dim=-1))    # comes back with the request's output
        x.mul_(0.5)                          # in-place edits reach the model
        return None                          # or a tensor of x's shape and dtype, to replace x

`ctx` says whose rows these are: `request_id`, `step` (0 at the request's first step),
`positions` (a range of token positions), `prompt_len`, `point`. At a `.resid` point the view is
hidden_states + residual, and edits are written back so that the sum is the edited value.
At a point sharded under tensor parallelism each GPU holds some of the columns: the runtime
all-gathers them into the single-GPU layout first (`Sharded`), every GPU runs the block on the
same whole rows, and each takes its own columns of the result back.

A batched block (`tapc.batched`, tapc/lang/blocks.py) is called once per point and step with the
rows of every request that runs it, `fn(batch, x)`: `x` spans their rows of the slab (rows of
other requests between them are left as they were), and `batch` (`BatchContext`) says whose
each row is. It works on a copy of the rows, written back once it returns.

A block that raises, or returns the wrong shape, fails its own request only (a batched one, the
requests of that call, whose rows it leaves as they were): the error (type, message,
traceback) is kept for that request, its blocks stop running, and every other request in the
batch goes on. Blocks run in the worker process: see docs/blocks.md for what a block may
close over.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import torch

from tapc.lang.blocks import is_batched
from tapc.wire.protocol import BlockFailure, encode_value

Block = Callable[["BlockContext", torch.Tensor], "torch.Tensor | None"]


@dataclass(frozen=True)
class Sharded:
    """How one GPU's columns of a sharded point become whole rows and back (tapc/plan/sharding.py):
    `all_gather` concatenates the GPUs' local tensors on the last dim, `index` picks the
    single-GPU layout out of that (`gather_index`), `holds` are this GPU's runs (dst, src, n)."""

    index: torch.Tensor
    holds: tuple[tuple[int, int, int], ...]
    all_gather: Callable[[torch.Tensor], torch.Tensor]

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_gather(x.contiguous())[:, self.index]

    def scatter(self, whole: torch.Tensor, x: torch.Tensor) -> None:
        for dst, src, n in self.holds:
            x[:, src:src + n] = whole[:, dst:dst + n]


@dataclass(frozen=True)
class BlockPoint:
    """One boundary op call site: what the plan taps there and which block runs."""

    key: str          # the point's key, e.g. "model.layers.3.mlp.output"
    block: str        # the block's name in the tap (`-> name`)
    sharded: Sharded | None = None   # set where the point is split across tensor-parallel GPUs


@dataclass(frozen=True)
class Span:
    """One request's rows in one step's slab: rows [start, end) at positions first_pos.."""

    rid: str
    start: int
    end: int
    first_pos: int


@dataclass
class BlockContext:
    request_id: str
    point: str
    step: int
    positions: range
    prompt_len: int
    saved: dict = field(default_factory=dict, repr=False)

    @property
    def is_prompt(self) -> bool:
        """Whether these rows are (all) prompt tokens."""
        return self.positions.stop <= self.prompt_len

    def save(self, name: str, value: Any) -> None:
        """Keep `value` for the request's output, one entry per call: a tensor (copied to the
        CPU now), None, a bool, int, float, str or bytes, or a list, tuple or dict (str keys) of
        these; anything else raises TypeError, which fails the request (docs/blocks.md)."""
        self.saved.setdefault(name, []).append(encode_value(value, f"ctx.save({name!r}, ...)"))


class BatchContext:
    """One call of a batched block: `x` holds rows `lo`.. of the step's slab, and `spans[i]` (rows
    of `x`, [start, end)) are request i's. The tensors (`mask`, `request_index`, `positions`)
    and the per-request contexts are made when first read."""

    def __init__(self, point: str, key: int, lo: int, members: list[tuple[Span, "Request"]], device):
        self.point = point
        self.spans = [(span.start - lo, span.end - lo) for span, _ in members]
        self._key, self._members, self._device = key, members, device
        self._rows = members[-1][0].end - lo

    def __len__(self) -> int:
        """The requests of this call."""
        return len(self._members)

    @property
    def request_ids(self) -> list[str]:
        return [req.rid for _, req in self._members]

    @cached_property
    def requests(self) -> list[BlockContext]:
        """Each request's context, as a per-request block gets it (`ctx.save` works too)."""
        return [BlockContext(req.rid, self.point, req.steps[self._key] - 1,
                             range(span.first_pos, span.first_pos + span.end - span.start), req.prompt_len, req.saved)
                for span, req in self._members]

    @cached_property
    def request_index(self) -> torch.Tensor:
        """[rows of x] int64 on x's device: the request (index into `requests`) of each row, -1
        for the rows of requests that do not run this block."""
        index = torch.full((self._rows,), -1, dtype=torch.int64)
        for i, (start, end) in enumerate(self.spans):
            index[start:end] = i
        return index.to(self._device, non_blocking=True)

    @cached_property
    def mask(self) -> torch.Tensor:
        """[rows of x] bool: the rows of requests that run this block."""
        return self.request_index >= 0

    @cached_property
    def positions(self) -> torch.Tensor:
        """[rows of x] int64: each row's token position in its request (-1 where no request)."""
        pos = torch.full((self._rows,), -1, dtype=torch.int64)
        for (start, end), (span, _) in zip(self.spans, self._members):
            pos[start:end] = torch.arange(span.first_pos, span.first_pos + end - start)
        return pos.to(self._device, non_blocking=True)

    def save(self, name: str, value: Any) -> None:
        """Keep each request's part of `value` for its output (`out.saved[name]`, one entry per
        call, as `ctx.save` keeps them): a tensor with a row of x's (rows first) gives each
        request its rows; a list or tuple with one entry per request gives each its entry."""
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == self._rows:
            rows = value.detach().cpu()
            parts = [rows[start:end] for start, end in self.spans]
        elif isinstance(value, (list, tuple)) and len(value) == len(self._members):
            parts = list(value)
        else:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"batch.save({name!r}, ...) takes a tensor of {self._rows} rows (x's) or a list of "
                            f"{len(self._members)} values (one a request), got {shape}")
        for (_, req), part in zip(self._members, parts):
            req.saved.setdefault(name, []).append(encode_value(part, f"batch.save({name!r}, ...)"))


class Request:
    """What the runtime keeps about one request that runs blocks."""

    def __init__(self, rid: str, prompt_len: int, blocks: dict[str, Block]):
        self.rid = rid                     # the request id blocks see (vLLM's)
        self.prompt_len = prompt_len
        self.blocks = blocks               # per-request overrides, by block name
        self.steps: dict[int, int] = {}    # point -> how many times its block ran for this request
        self.saved: dict = {}
        self.error: BlockFailure | None = None


class BlockRuntime:
    """The handler of `tapc::boundary`: runs each request's block on its own rows."""

    def __init__(self, points: list[BlockPoint]):
        self.points = points
        self.blocks: dict[str, Block] = {}     # engine-wide, by name
        self.requests: dict[str, Request] = {}
        self.spans: list[Span] = []
        self.elsewhere = False

    def register(self, blocks: dict[str, Block]) -> None:
        self.blocks.update(blocks)

    def admit(self, key: str, prompt_len: int, blocks: dict[str, Block] | None = None,
              request_id: str | None = None) -> None:
        """A request that runs blocks, under `key` (spans and `take` use it); its blocks see
        `request_id` (default: the key)."""
        self.requests.setdefault(key, Request(request_id or key, prompt_len, dict(blocks or {})))

    def begin_step(self, spans: list[Span], elsewhere: bool = False) -> None:
        """The rows of this step's requests (those the runtime did not admit are skipped).
        `elsewhere`: the step holds a request that another GPU of the group admitted and this
        one could not (no room for its captures here): its blocks run there, so the collectives
        of sharded points must run here too."""
        self.spans = spans
        self.elsewhere = elsewhere

    def take(self, rid: str) -> tuple[dict, BlockFailure | None]:
        """A finished request's saved values (in wire form, protocol.encode_value) and error, once."""
        req = self.requests.pop(rid, None)
        return (req.saved, req.error) if req else ({}, None)

    def __call__(self, point: int, x: torch.Tensor, b: torch.Tensor | None) -> None:
        """`tapc::boundary`'s handler: this step's spans, rows of the forward's slab."""
        self.run(point, x, b, self.spans)

    def run(self, point: int, x: torch.Tensor, b: torch.Tensor | None, spans: list[Span]) -> None:
        """Each request's block on its rows of `x` (engine points pass their own rows).

        At a `.resid` point (`b`, the residual, given) blocks see hidden + residual: the sum is
        made once for each run of adjacent rows that run blocks, and written back once
        (hidden = sum - residual), not per request: per-request kernels would cost a few
        launches for every request at every step."""
        bp = self.points[point]
        if bp.sharded is not None:
            # The all-gather is a collective: every GPU of the group must make it, so whether it
            # runs hangs on what the scheduler gave all of them alike (tapped requests, admitted
            # here or elsewhere), never on a block's error, which one GPU alone might see.
            if not (self.elsewhere or any(span.rid in self.requests for span in spans)):
                return
            flat = x if x.dim() == 2 else x.view(x.shape[0], -1)   # a view: the scatter reaches x
            whole = bp.sharded.whole(flat)
            self._run_spans(bp, point, whole, None, spans)
            bp.sharded.scatter(whole, flat)
            return
        self._run_spans(bp, point, x, b, spans)

    def _run_spans(self, bp: BlockPoint, point: int, x: torch.Tensor, b: torch.Tensor | None,
                   spans: list[Span]) -> None:
        live, groups = [], {}
        for span in spans:
            req = self.requests.get(span.rid)
            if req is None or req.error is not None:
                continue
            fn = req.blocks.get(bp.block, self.blocks.get(bp.block))
            if fn is not None and is_batched(fn):
                groups.setdefault(id(fn), (fn, []))[1].append((span, req))
            else:
                live.append((span, req))
        for fn, members in groups.values():
            self._run_batched(fn, bp, point, x, b, members)
        for lo, hi, run in _adjacent(live):
            rows = x[lo:hi] if b is None else x[lo:hi] + b[lo:hi]
            for span, req in run:
                fn = req.blocks.get(bp.block, self.blocks.get(bp.block))
                try:
                    if fn is None:
                        raise LookupError(f"no block named {bp.block!r}: register it on the engine "
                                          f"(VLLM(..., blocks={{{bp.block!r}: fn}})) or pass it with the request")
                    self._run(fn, point, req, span, rows[span.start - lo: span.end - lo])
                except Exception as exc:  # the request fails; the batch goes on
                    req.error = BlockFailure.capture(bp.block, bp.key, exc)
            if b is not None:
                x[lo:hi] = rows - b[lo:hi]

    def _run_batched(self, fn: Callable, bp: BlockPoint, point: int, x: torch.Tensor, b: torch.Tensor | None,
                     members: list[tuple[Span, Request]]) -> None:
        """One call of a batched block on a copy of its requests' rows (at a `.resid` point,
        hidden + residual), written back where it returns; where it raises, its requests fail
        and their rows stay as they were."""
        lo, hi = members[0][0].start, members[-1][0].end
        rows = x[lo:hi] + b[lo:hi] if b is not None else x[lo:hi].clone()
        for _, req in members:
            req.steps[point] = req.steps.get(point, 0) + 1
        batch = BatchContext(bp.key, point, lo, members, x.device)
        try:
            out = _returned(bp, fn(batch, rows), rows)
            if out is not None:
                rows = out.to(rows.dtype)
        except Exception as exc:  # the requests of this call fail; the batch goes on
            failure = BlockFailure.capture(bp.block, bp.key, exc)
            for _, req in members:
                req.error = failure
            return
        new = rows if b is None else rows - b[lo:hi]
        if sum(span.end - span.start for span, _ in members) == hi - lo:
            x[lo:hi] = new
        else:   # rows of requests without this block between them: theirs stay
            x[lo:hi] = torch.where(batch.mask[:, None], new, x[lo:hi])

    def _run(self, fn: Block, point: int, req: Request, span: Span, view: torch.Tensor) -> None:
        bp = self.points[point]
        step = req.steps.get(point, 0)
        req.steps[point] = step + 1
        ctx = BlockContext(req.rid, bp.key, step, range(span.first_pos, span.first_pos + span.end - span.start),
                           req.prompt_len, req.saved)
        out = _returned(bp, fn(ctx, view), view)
        if out is not None:
            view.copy_(out)


def _returned(bp: BlockPoint, out, x: torch.Tensor) -> "torch.Tensor | None":
    """What a block returned, checked: None, or a tensor of `x`'s shape."""
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != x.shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"block `{bp.block}` returned {got}; return None (edit x in place) or a "
                         f"tensor of x's shape {tuple(x.shape)}")
    return out


def _adjacent(live: list[tuple[Span, Request]]):
    """(first row, end row, members) of each run of spans whose rows follow one another."""
    run: list[tuple[Span, Request]] = []
    for item in live:
        if run and item[0].start != run[-1][0].end:
            yield run[0][0].start, run[-1][0].end, run
            run = []
        run.append(item)
    if run:
        yield run[0][0].start, run[-1][0].end, run
