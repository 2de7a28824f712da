"""The request side of a tapped engine, without I/O: what goes into vLLM and what comes back.

`VLLM.generate` (llm.py) drives these steps around its own engine calls, and so can an async
engine or an HTTP route around theirs:

    checked = session.check(ask, "request 3")             # RequestError before anything is sent
    prepared = session.prepare(sampling_params, checked, "request 3")   # tapc id, SamplingParams
    prompt = salted(prompt, prepared.salt)     # its prefix-cache salt, if it edits (tapc/api/prefix.py)
    chunks = session.released()      # -> collective_rpc("tapc_release", chunks), before submitting
    ... submit the prompt with prepared.params; wait for its final output `out` ...
    replies = collective_rpc("tapc_collect", session.wanted([prepared]))  # one per worker; tapped only
    session.finish(out, prepared.wire, session.results(replies).get(prepared.id))
    out.taps, out.saved, out.error

`prepare_batch` and `finish_batch` are the loops `generate` needs: one SamplingParams and one
TapRequest fanned out over the prompts, each distinct TapRequest checked once, and every
result's chunks owned by exactly one place (a tensor the caller holds, or given back).

Named `session` because it holds what spans calls of one engine (the plan, engine-wide
parameter values and blocks, the reader of the capture arena and its release notes);
`tapc.serving.client` is the name for the HTTP client wrapper of the serving issue.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tapc.api.gather import gathered, place
from tapc.api.prefix import PrefixPolicy, salted
from tapc.api.requests import TapRequest, check, check_engine_params, check_fields, patch_positions
from tapc.errors import EngineError, ProtocolError, RequestError, TapcError
from tapc.plan.pattern import is_pattern, shape_of
from tapc.plan.tapplan import ENGINE, TapPlan
from tapc.wire.arena import ArenaReader
from tapc.wire.positions import beyond_pattern, expected_rows, last_reachable, unreached
from tapc.wire.protocol import Ask, Result, WireRequest

log = logging.getLogger("tapc")


@dataclass(frozen=True)
class Prepared:
    """One request ready to submit: `params` (the caller's own object when untapped, else a
    copy carrying the wire and whether it may read the prefix cache), its wire (None:
    untapped) and the `cache_salt` its prompt must carry (tapc/api/prefix.py; None: none)."""

    params: object
    wire: WireRequest | None
    salt: str | None = None

    @property
    def id(self) -> str | None:
        return None if self.wire is None else self.wire.id


class Taps(dict):
    """A request's captures by key. A key it does not have says why: the request's error, or
    the keys it did capture. `unreached`: the listed positions it asked for that the request
    never reached (it stopped before them), which have no row."""

    def __init__(self, captures=(), error: BaseException | None = None, unreached: tuple[int, ...] = ()):
        super().__init__(captures)
        self.error = error
        self.unreached = unreached

    def __missing__(self, key):
        if self.error is not None:
            raise KeyError(f"{key!r}: this request's taps failed: {self.error}") from self.error
        have = ", ".join(self) or "nothing (its TapRequest asks for no capture)"
        raise KeyError(f"{key!r} was not captured for this request; it has {have}")


def plan_blocks(plan: TapPlan, names: Iterable[str] = ()) -> set[str]:
    """The names of the plan's blocks; `EngineError` if `names` (blocks given to the engine)
    has one the plan does not run."""
    known = {t.block for t in plan.taps if t.action == "block"}
    unknown = set(names) - known
    if unknown:
        raise EngineError(f"blocks= names {', '.join(sorted(unknown))}, which no tap of the plan runs "
                          f"(the plan's blocks: {', '.join(sorted(known)) or 'none'})")
    return known


class TapSession:
    """`plan`: the engine's plan; `params`: engine-wide parameter values (checked now, so a bad
    one fails at construction); `blocks`: names of the blocks registered on the engine;
    `prefix_caching`: the engine's enable_prefix_caching."""

    def __init__(self, plan: TapPlan, params: dict | None = None, blocks: Iterable[str] = (),
                 prefix_rows: bool = False, max_model_len: int | None = None, prefix_caching: bool = True):
        self.plan = plan
        # attention patterns: key -> (heads, keys) of a row, which comes back [rows, heads, keys]
        self.patterns = {t.key: shape_of(t) for t in plan.taps if is_pattern(t)}
        self.pattern_keys = {k: keys for k, (_, keys) in self.patterns.items()}
        self.max_model_len = max_model_len   # the engine's, once it is known: bounds requests' positions
        self.block_names = plan_blocks(plan, blocks)
        self.engine_blocks = set(blocks)
        self.params = dict(params or {})
        if self.params:
            check_engine_params(plan, self.params, "engine params")
        # Blocks and engine points run for every request: each needs an id to bring results back.
        self.every = bool(self.block_names) or any(t.kind == ENGINE for t in plan.taps)
        self.arena = ArenaReader()
        # rows_kept: the engine keeps prefix rows (prefixrows.py)
        self.prefix = PrefixPolicy(plan, rows_kept=prefix_rows, caching=prefix_caching)

    # ---------------------------------------------------------------- going in

    @property
    def taps_all(self) -> bool:
        """Whether a request that asks for nothing is tapped too: blocks or engine points run for
        every request, or engine-wide parameter values bind its edits."""
        return self.every or bool(self.params)

    def with_defaults(self, ask: TapRequest | None) -> TapRequest | None:
        """A request's own parameter values over the engine's."""
        if not self.params:
            return ask
        ask = ask or TapRequest()
        return dataclasses.replace(ask, params={**self.params, **ask.params})

    def check(self, ask: TapRequest | None, where: str) -> Ask | None:
        """The checked ask of one request (engine defaults applied), or None when it runs
        untapped. A `RequestError` names `where`."""
        if ask is not None:   # its types, before the engine's values are merged into its params
            check_fields(ask, where)
        ask = self.with_defaults(TapRequest() if ask is None and self.every else ask)
        if ask is None:
            return None
        checked = check(self.plan, ask, where, self.max_model_len)
        missing = self.block_names - self.engine_blocks - set(ask.blocks)
        if missing:
            raise RequestError(f"{where}: the plan runs block(s) {', '.join(sorted(missing))}, but neither the "
                               "engine (VLLM(..., blocks=...)) nor the request (TapRequest(blocks=...)) gives them")
        return checked if self.every or not checked.empty else None

    def check_reach(self, checked: Ask, prompt_len: int | None, max_tokens: int | None, where: str) -> None:
        """A `RequestError` where a listed position lies beyond any the request can reach (its
        prompt and max_tokens, the engine's max_model_len: tapc/wire/positions.py), which would
        come back with no row."""
        if prompt_len is not None and max_tokens is not None:
            beyond = beyond_pattern(self.pattern_keys, checked.capture, checked.positions, prompt_len, max_tokens)
            if beyond is not None:
                raise RequestError(f"{where}: {beyond}")
        listed = () if isinstance(checked.positions, str) else checked.positions
        patched = patch_positions(self.plan, checked.params) if checked.params else ()
        if not listed and not patched:
            return
        bound = last_reachable(prompt_len, max_tokens, self.max_model_len)
        for what, positions in (("", listed), ("patch() rows at ", patched)):
            beyond = [p for p in positions if bound is not None and p > bound[0]]
            if beyond:
                raise RequestError(f"{where}: {what}{'positions' if len(beyond) > 1 else 'position'} "
                                   f"{shown_list(beyond)} {'lie' if len(beyond) > 1 else 'lies'} beyond the last "
                                   f"this request can reach, {bound[0]} ({bound[1]})")

    def prepare(self, sampling_params, checked: Ask | None, where: str, prompt=None) -> Prepared:
        """One request to submit, from its checked ask: its tapc id (made here, once) travels
        in a copy of its SamplingParams, with what it may do with the prefix cache. `prompt`
        (where given, and given as token ids) bounds the positions it may ask for."""
        if checked is None:
            return Prepared(sampling_params, None)
        self.check_reach(checked, prompt_tokens(prompt), sampling_params.max_tokens, where)
        if sampling_params.n != 1:
            raise RequestError(f"{where}: taps with n={sampling_params.n} samples per prompt are not supported; "
                               "repeat the prompt instead")
        wire = WireRequest(uuid.uuid4().hex, checked)
        # A shallow copy: vLLM deep-copies the params of every request before it changes them
        # (InputProcessor.process_inputs), so only extra_args needs to be our own.
        sp = copy.copy(sampling_params)
        sp.extra_args = {**(sp.extra_args or {}), "tapc": wire.to_wire()}
        use = self.prefix.use(checked, wire.id)
        if use.skip_read:
            sp.skip_reading_prefix_cache = True
        return Prepared(sp, wire, use.salt)

    def prepare_batch(self, prompts, sampling_params=None,
                      taps: TapRequest | Sequence[TapRequest | None] | None = None) -> tuple[list, list[Prepared]]:
        """`generate`'s arguments as lists of prompts (salted where `prepare` says) and prepared
        requests. Every request is checked before any is returned, so a bad one submits nothing."""
        from vllm import SamplingParams

        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        n = len(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * n
        asks = list(taps) if isinstance(taps, Sequence) else [taps] * n
        if len(params) != n or len(asks) != n:
            raise RequestError(f"{n} prompts but {len(params)} sampling params and {len(asks)} tap requests")
        checked: dict[int, Ask | None] = {}   # id(TapRequest) -> its check: a shared one is checked once
        out = []
        for i, (sp, ask) in enumerate(zip(params, asks)):
            if id(ask) not in checked:
                checked[id(ask)] = self.check(ask, f"request {i}")
            out.append(self.prepare(sp, checked[id(ask)], f"request {i}", prompts[i]))
        return [salted(prompt, p.salt) for prompt, p in zip(prompts, out)], out

    def released(self) -> list[tuple[str, int]]:
        """Capture chunks the caller has dropped since the last call: the worker may reuse them
        (`tapc_release`). Send them before submitting more."""
        return self.arena.drain()

    # ---------------------------------------------------------------- coming back

    @staticmethod
    def wanted(prepared: Sequence[Prepared]) -> list[str]:
        """The tapc ids to collect: every tapped request, also those that only edit (the worker
        drops its record then, and says if the request ran untapped)."""
        return [p.wire.id for p in prepared if p.wire is not None]

    def results(self, replies) -> dict[str, Result]:
        """The `tapc_collect` replies (wire form) by tapc id: one reply, or a list of one per
        worker (in rank order; under data parallelism each engine's in turn, `every_worker`),
        one result per request (gather.py); rows nobody will see go back with `released()`."""
        return gathered(replies, self.plan.tensor_parallel_size, self.plan.pipeline_parallel_size, self.discard)

    def finish(self, out, wire: WireRequest | None, result: Result | None) -> None:
        """Give vLLM's output `out` its `taps`, `saved` and `error`. What went wrong for this
        request is its `out.error`, never an exception: the other requests are unaffected."""
        out.taps, out.saved, out.error = Taps(), {}, None
        if wire is None:
            return
        try:
            if result is None:
                raise ProtocolError(f"request {out.request_id}: the engine's reply has no result for it")
            out.taps = Taps(self._assemble(out, wire, result),
                            unreached=unreached(wire.ask.positions, len(out.prompt_token_ids),
                                                len(out.outputs[0].token_ids)))
        except TapcError as e:
            # Without its traceback: those frames would keep every output of this call, and the
            # captures they view, alive as long as the caller keeps the error.
            e = e.with_traceback(None)
            log.warning("tapc: request %s failed: %s", out.request_id, e)
            out.taps, out.error = Taps(error=e), e
            return
        _attach_points(out, result)

    def finish_batch(self, outs: list, prepared: Sequence[Prepared], reply) -> list:
        """`finish` for each output of a `generate` call; `reply` is the collect reply, or the
        list of them, one per worker (None when nothing was collected)."""
        got = self.results(reply) if reply is not None else {}
        try:
            for out, p in zip(outs, prepared):
                self.finish(out, p.wire, got.pop(p.id, None) if p.wire is not None else None)
        finally:  # results not assembled (an error above): no tensor will hold their chunks
            for result in got.values():
                self.discard(result)
        return outs

    def _assemble(self, out, wire: WireRequest, result: Result) -> dict[str, torch.Tensor]:
        """Per key `[rows, width]`, rows in position order: views of the engine's arena, no copy
        (the reader notes each chunk's release when the caller drops its last view; the chunks
        not viewed are noted now). Rows of a step vLLM ran after the request's last token (async
        scheduling) are cut off."""
        if result.error is not None:
            raise RequestError(f"request {out.request_id}: {result.error}")
        generated = len(out.outputs[0].token_ids)
        keep = expected_rows(wire.ask.positions, len(out.prompt_token_ids), generated)
        short = [store.rows for store in result.stores if store.rows < keep]
        if short:
            self.discard(result)
            raise EngineError(f"request {out.request_id}: {short[0]} rows captured for {keep} positions")
        taps: dict[str, torch.Tensor] = {}
        shards = self.plan.shard_map
        parts_of: dict[str, list] = {}   # sharded key -> (rank, its local [rows, local width] view)
        for store in result.stores:
            keys, width, dtype = store.keys, store.width, getattr(torch, store.dtype)
            parts, done = [], 0
            for chunk in store.chunks:
                n = min(chunk.written, keep - done)
                if n <= 0:
                    self._unused(chunk)
                    continue
                if chunk.data is not None:   # from a GPU on another node: the rows came in the reply
                    rows = torch.frombuffer(bytearray(chunk.data), dtype=dtype).view(chunk.written, len(keys), width)
                else:
                    rows = self.arena.view(chunk.path, chunk.offset, (chunk.rows, len(keys), width), dtype)
                parts.append(rows[:n])
                done += n
            # One chunk is the usual case (the first is sized for every row the request can
            # have); several are joined by a copy, and go back as soon as `parts` is dropped.
            block = parts[0] if len(parts) == 1 else torch.cat(parts or [torch.empty((0, len(keys), width), dtype=dtype)])
            for j, k in enumerate(keys):
                if k in shards and shards[k].sharded:
                    parts_of.setdefault(k, []).append((store.rank, block[:, j]))
                elif k in self.patterns:
                    taps[k] = block[:, j].view(-1, *self.patterns[k])
                else:
                    taps[k] = block[:, j]
        for k, parts in parts_of.items():
            taps[k] = place(shards[k], parts, out.request_id)
        return taps

    def discard(self, result: Result) -> None:
        """A collected result nobody will see (its request was cancelled, or failed before it
        was assembled): every chunk of it goes back with the next `released()`."""
        for store in result.stores:
            for chunk in store.chunks:
                self._unused(chunk)

    def _unused(self, chunk) -> None:
        if chunk.data is None:   # rows sent inline have no block left to give back
            self.arena.unused(chunk.path, chunk.offset)


def prompt_tokens(prompt) -> int | None:
    """The length of a prompt given as token ids (a list, or `{"prompt_token_ids": [...]}`);
    None for text, whose tokens the engine makes."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    return len(ids) if isinstance(ids, list) and all(isinstance(t, int) for t in ids[:1]) else None


def shown_list(values: list[int], limit: int = 5) -> str:
    return ", ".join(map(str, values[:limit])) + (f" and {len(values) - limit} more" if len(values) > limit else "")


def _attach_points(out, result: Result) -> None:
    """Engine points (`logits` [G, vocab], `samples` [G]), blocks' saved values and a block's error.
    A step vLLM ran past the request's last token is dropped, as for captures."""
    generated = len(out.outputs[0].token_ids)
    for key, data in result.engine.items():
        rows = data.tensor()[:generated]
        out.taps[key] = rows.reshape(-1) if key == "samples" else rows
    out.saved = result.saved_values()
    out.error = result.block_error.exception_for_caller() if result.block_error is not None else None
