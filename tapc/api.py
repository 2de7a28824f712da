"""`VLLM(model, taps=[...])`: a vLLM engine with taps compiled into its graphs.

    llm = VLLM("path/to/model", taps=["model.layers.*.resid", "model.layers.10.resid | add(steer, alpha=4.0)"])
    outs = llm.generate(prompts, SamplingParams(max_tokens=32),
                        taps=TapRequest(capture=["model.layers.*.resid"], params={"steer": v}))
    outs[0].taps["model.layers.3.resid"]     # [rows, hidden] on the CPU, rows as `positions` says,
                                             # a view of shared memory (no copy; see docs/engine.md)

`generate` takes and returns what vLLM's `LLM.generate` does; each RequestOutput gets a
`taps` dict (empty when the request captured nothing). See docs/engine.md.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
import uuid
from collections.abc import Sequence

import torch

from tapc.engine.arena import ArenaReader
from tapc.engine.config import engine_kwargs, require_cuda
from tapc.engine.requests import TapRequest, check_engine_params, to_wire
from tapc.engine.tables import expected_rows
from tapc.errors import EngineError, RequestError, TapcError
from tapc.plan import ENGINE, TapPlan, build_plan

__all__ = ["VLLM", "TapRequest", "Taps"]

log = logging.getLogger("tapc")

# The plan sizes buffers and tables for these unless the caller sets them; the engine gets the
# same values (vLLM's own defaults depend on the GPU).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256


class VLLM:
    """vLLM's `LLM` with taps. `taps`: tap strings (see `tapc explain`); `blocks`: Python blocks
    by name (docs/blocks.md); `params`: engine-wide parameter values, used by every request that
    does not pass its own; `capture_dtype`: dtype captures are stored in (default: the model's).
    Other keyword arguments go to `vllm.LLM` (prefix caching is turned off; see docs/engine.md)."""

    def __init__(self, model: str, taps: Sequence[str], *, blocks: dict | None = None, params: dict | None = None,
                 capture_dtype: str | None = None, **kwargs):
        require_cuda()
        from vllm import LLM

        kwargs.setdefault("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        kwargs.setdefault("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        self.plan: TapPlan = build_plan(model, list(taps), max_num_batched_tokens=kwargs["max_num_batched_tokens"],
                                        max_num_seqs=kwargs["max_num_seqs"], capture_dtype=capture_dtype)
        self._set_params(params)
        self.block_names = {t.block for t in self.plan.taps if t.action == "block"}
        self.blocks = dict(blocks or {})
        unknown = set(self.blocks) - self.block_names
        if unknown:
            raise EngineError(f"blocks= names {', '.join(sorted(unknown))}, which no tap of the plan runs "
                              f"(the plan's blocks: {', '.join(sorted(self.block_names)) or 'none'})")
        self.llm = LLM(model=model, **engine_kwargs(self.plan, kwargs))
        self._arena = ArenaReader()
        if self.blocks:
            import cloudpickle

            self.llm.collective_rpc("tapc_set_blocks", args=(cloudpickle.dumps(self.blocks),))

    @classmethod
    def from_spec(cls, spec, **overrides) -> "VLLM":
        """An engine from a YAML spec (a path or a loaded `Spec`): its model, engine arguments,
        taps, parameters (tensors loaded from their files) and capture dtype. `overrides` are
        more keyword arguments (e.g. blocks=, attention_backend=)."""
        from tapc.specfile import Spec, TensorFile, load_spec, load_tensor

        spec = spec if isinstance(spec, Spec) else load_spec(spec)
        params = {k: load_tensor(v) if isinstance(v, TensorFile) else v for k, v in spec.params.items()}
        return cls(spec.model, [t.text for t in spec.taps], params=params or None,
                   capture_dtype=spec.capture.dtype, **{**spec.engine, **overrides})

    def _set_params(self, params: dict | None) -> None:
        """Engine-wide values, checked against the plan now so a bad one fails at construction."""
        self.params = dict(params or {})
        if self.params:
            check_engine_params(self.plan, self.params, "engine params")

    def _with_defaults(self, ask: TapRequest | None) -> TapRequest | None:
        """A request's own parameter values over the engine's."""
        if not self.params:
            return ask
        ask = ask or TapRequest()
        return dataclasses.replace(ask, params={**self.params, **ask.params})

    def generate(self, prompts, sampling_params=None, *, taps: TapRequest | Sequence[TapRequest | None] | None = None,
                 **kwargs) -> list:
        """vLLM's `generate`, with `taps`: one `TapRequest` for every prompt, or one per prompt
        (None: untapped). A request asking for something the plan lacks raises `RequestError`
        before anything is submitted (as vLLM does for a bad prompt). What fails once requests
        run (no room for a request's captures, a raising block) fails that request only: its
        `out.error` says why, and every other request's results come back."""
        from vllm import SamplingParams

        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        n = len(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * n
        asks = list(taps) if isinstance(taps, Sequence) else [taps] * n
        if len(params) != n or len(asks) != n:
            raise RequestError(f"{n} prompts but {len(params)} sampling params and {len(asks)} tap requests")
        # Blocks and engine points run for every request: each needs an id to bring results back.
        every = bool(self.block_names) or any(t.kind == ENGINE for t in self.plan.taps)
        wires: list[dict | None] = []
        checked: dict[int, dict | None] = {}   # id(TapRequest) -> its wire: a shared one is checked once
        batch = uuid.uuid4().hex[:16]
        for i, (sp, ask) in enumerate(zip(params, asks)):
            if id(ask) not in checked:
                checked[id(ask)] = self._wire(ask, every, f"request {i}")
            wire = checked[id(ask)]
            if wire is not None:
                if sp.n != 1:
                    raise RequestError(f"request {i}: taps with n={sp.n} samples per prompt are not supported; "
                                       "repeat the prompt instead")
                wire = dict(wire, id=f"{batch}-{i}")
                # A shallow copy: vLLM deep-copies the params of every request before it changes
                # them (InputProcessor.process_inputs), so only extra_args needs to be our own.
                sp = copy.copy(sp)
                sp.extra_args = {**(sp.extra_args or {}), "tapc": wire}
                params[i] = sp
            wires.append(wire)
        self._give_back()
        outs = self.llm.generate(prompts, params, **kwargs)
        # Every tapped request is collected, also those that only edit: the worker drops its
        # record then, and says if the request ran untapped.
        wanted = [w["id"] for w in wires if w is not None]
        got = self.llm.collective_rpc("tapc_collect", args=(wanted,))[0] if wanted else {}
        try:
            for out, wire in zip(outs, wires):
                out.taps, out.saved, out.error = Taps(), {}, None
                if wire is None:
                    continue
                result = got.pop(wire["id"])
                try:
                    out.taps = Taps(_assemble(out, wire, result, self._arena))
                except TapcError as e:
                    # Without its traceback: those frames would keep every output of this call,
                    # and the captures they view, alive as long as the caller keeps the error.
                    e = e.with_traceback(None)
                    log.warning("tapc: request %s failed: %s", out.request_id, e)
                    out.taps, out.error = Taps(error=e), e
                    continue
                _attach_points(out, result)
        finally:  # results not assembled (an error above): no tensor will hold their chunks
            for result in got.values():
                _disown(result, self._arena)
        return outs

    def _give_back(self) -> None:
        """Tell the worker which capture chunks the caller has dropped since the last call."""
        chunks = self._arena.drain()
        if chunks:
            self.llm.collective_rpc("tapc_release", args=(chunks,))

    def _wire(self, ask: TapRequest | None, every: bool, where: str) -> dict | None:
        """The checked wire of one request's ask (its id is set per request), or None when the
        request runs untapped."""
        ask = self._with_defaults(TapRequest() if ask is None and every else ask)
        if ask is None:
            return None
        wire = to_wire(self.plan, ask, where)
        self._check_blocks(ask, where)
        return wire if wire["capture"] or wire["params"] or every else None

    def _check_blocks(self, ask: TapRequest, where: str) -> None:
        missing = self.block_names - set(self.blocks) - set(ask.blocks)
        if missing:
            raise RequestError(f"{where}: the plan runs block(s) {', '.join(sorted(missing))}, but neither the "
                               "engine (VLLM(..., blocks=...)) nor the request (TapRequest(blocks=...)) gives them")


class Taps(dict):
    """A request's captures by key. A key it does not have says why: the request's error, or
    the keys it did capture."""

    def __init__(self, captures=(), error: BaseException | None = None):
        super().__init__(captures)
        self.error = error

    def __missing__(self, key):
        if self.error is not None:
            raise KeyError(f"{key!r}: this request's taps failed: {self.error}") from self.error
        have = ", ".join(self) or "nothing (its TapRequest asks for no capture)"
        raise KeyError(f"{key!r} was not captured for this request; it has {have}")


def _assemble(out, wire: dict, result: dict, arena: ArenaReader) -> dict[str, torch.Tensor]:
    """Per key `[rows, width]`, rows in position order: views of the engine's arena, no copy
    (`arena` notes each chunk's release when the caller drops its last view; the chunks not
    viewed are noted now). Rows of a step vLLM ran after the request's last token (async
    scheduling) are cut off."""
    if "error" in result:
        raise RequestError(f"request {out.request_id}: {result['error']}")
    generated = len(out.outputs[0].token_ids)
    keep = expected_rows(wire["positions"], len(out.prompt_token_ids), generated)
    short = [store["rows"] for store in result["stores"] if store["rows"] < keep]
    if short:
        _disown(result, arena)
        raise EngineError(f"request {out.request_id}: {short[0]} rows captured for {keep} positions")
    taps: dict[str, torch.Tensor] = {}
    for store in result["stores"]:
        keys, width, dtype = store["keys"], store["width"], getattr(torch, store["dtype"])
        parts, done = [], 0
        for path, offset, rows, written in store["chunks"]:
            n = min(written, keep - done)
            if n <= 0:
                arena.unused(path, offset)
                continue
            parts.append(arena.view(path, offset, (rows, len(keys), width), dtype)[:n])
            done += n
        # One chunk is the usual case (the first is sized for every row the request can have);
        # several are joined by a copy, and go back as soon as `parts` is dropped.
        block = parts[0] if len(parts) == 1 else torch.cat(parts or [torch.empty((0, len(keys), width), dtype=dtype)])
        taps.update({k: block[:, j] for j, k in enumerate(keys)})
    return taps


def _disown(result: dict, arena: ArenaReader) -> None:
    """A collected result no tensor will view: every chunk of it can go back."""
    for store in result.get("stores", ()):
        for path, offset, *_ in store["chunks"]:
            arena.unused(path, offset)


def _attach_points(out, result: dict) -> None:
    """Engine points (`logits` [G, vocab], `samples` [G]), blocks' saved values and a block's error.
    A step vLLM ran past the request's last token is dropped, as for captures."""
    if "points" not in result:
        return
    got = pickle.loads(result["points"])
    generated = len(out.outputs[0].token_ids)
    for key, rows in got["engine"].items():
        rows = rows[:generated]
        out.taps[key] = rows.reshape(-1) if key == "samples" else rows
    out.saved = got["saved"]
    out.error = got["error"].exception_for_caller() if got["error"] is not None else None
