"""What one request may do with vLLM's prefix cache: read cached KV, and share the KV it leaves.

vLLM serves a prompt's cached prefix without running the forward over it, so those rows never
reach a tap: a capture of them would come back short, and an edit would not be applied to
them. A tapped engine keeps prefix caching on for all traffic and decides per request:

- A request that edits nothing in the graphs computes the same KV as vanilla vLLM: it reads
  and leaves cache like any other request.
- A capture of rows a cached prefix could cover (positions "all", "prompt", or a list) sets
  `SamplingParams.skip_reading_prefix_cache`: vLLM then computes every row of it (it finds no
  cache hit at all, `KVCacheManager.get_computed_blocks`), and its KV, equal to vanilla's,
  is still cached for others. On an engine that keeps captured rows of shared prompt blocks
  (`prefix_rows_gib`, tapc/worker/prefixrows.py) it reads the cache as far as those rows go instead. "generated" and "last" rows are always computed: vLLM recomputes
  at least the last prompt token (`max_cache_hit_length = num_tokens - 1`).
- A request with an in-graph edit (steering, ablation, ...) computes KV of its own, for every
  position the edit reaches and every later one; even an edit `at=generated` leaves KV that a
  later prompt containing those tokens (the next turn of a chat) would reuse. It gets a
  `cache_salt` (vLLM mixes it into the first block's hash, so every block of the request is
  keyed apart) derived from what changes its KV: the edits that apply to it and their values.
  Requests with identical edits share the cache; unsteered traffic never reads steered KV, nor
  the other way round. The salt is an HMAC under a key made per session, so a client cannot
  forge another's salt to read its KV.
- Python blocks are opaque (they may read every row and edit), and they run on every request:
  each request gets a salt of its own, i.e. no sharing at all on an engine with blocks.
Edits of the logits change which token is sampled, not the KV of a given token: no salt.
An engine with prefix caching off reads and shares no KV: nothing to decide, no salt to make.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass

from tapc.plan.tapplan import BLOCK, EDIT, TapPlan
from tapc.wire.positions import ALWAYS_COMPUTED
from tapc.wire.protocol import Ask


@dataclass(frozen=True)
class CacheUse:
    """skip_read: the request must not read cached KV; salt: its cache_salt (None: shares vanilla's)."""

    skip_read: bool = False
    salt: str | None = None


class PrefixPolicy:
    """One engine's rule (the plan's edits and blocks) and its salt key."""

    def __init__(self, plan: TapPlan, key: bytes | None = None, rows_kept: bool = False, caching: bool = True):
        self.caching = caching             # the engine's enable_prefix_caching
        self.plan = plan
        self.blocks = any(t.kind == BLOCK for t in plan.taps)
        # The engine keeps captured rows of shared prompt blocks (tapc/worker/prefixrows.py): its
        # scheduler lets a capture read cached KV as far as those go, so it need not skip.
        self.rows_kept = rows_kept
        self.key = key if key is not None else os.urandom(32)
        # The last ask's cache use: a batch shares one checked ask among its prompts (64 prompts
        # with a direction projected out of 32 layers hashed it 2,048 times, 15-35 ms a call).
        self._last: tuple[Ask, CacheUse] | None = None

    def use(self, ask: Ask | None, tid: str | None) -> CacheUse:
        """The cache use of a request with checked ask `ask` and tapc id `tid` (None: untapped)."""
        if ask is None or not self.caching:
            return CacheUse()
        if self.blocks:
            return CacheUse(skip_read=True, salt=self.unique(tid))
        if self._last is not None and self._last[0] is ask:
            return self._last[1]
        skip = bool(ask.capture) and ask.positions not in ALWAYS_COMPUTED and not self.rows_kept
        applied = [t for t in self.plan.taps_reading(ask.params) if t.kind == EDIT and _binds(t, ask.params)]
        if not applied:
            use = CacheUse(skip_read=skip)
        else:
            canon = {name: _canon(value) for name, value in ask.params.items()}   # a glob's edits share values
            what = [[t.source, {a.param: canon[a.param] for a in t.args if a.param is not None}] for t in applied]
            use = CacheUse(skip_read=skip, salt=self._sign(["edits", what]))
        self._last = (ask, use)
        return use

    def unique(self, tid: str) -> str:
        """A salt no other request has: for a server, which cannot set `skip_reading_prefix_cache`
        through the OpenAI API, the way to read no cached KV (its own KV is then shared with nobody)."""
        return self._sign(["request", tid])

    def _sign(self, what) -> str:
        text = json.dumps(what, sort_keys=True, separators=(",", ":"))
        return "tapc-" + hmac.new(self.key, text.encode(), hashlib.sha256).hexdigest()[:32]


def _binds(tap, params) -> bool:
    """The edit applies to the request: a parameterless edit applies to every request (vanilla
    traffic included, so it changes no one's sharing); one with parameters, when all are bound."""
    names = [a.param for a in tap.args if a.param is not None]
    return bool(names) and all(n in params for n in names)


def _canon(value):
    """A checked parameter value (protocol.ParamValue) as JSON: vectors by their bytes' hash."""
    return hashlib.sha256(value).hexdigest() if isinstance(value, bytes) else value


def salted(prompt, salt: str | None):
    """`prompt` (a string or vLLM prompt dict) with `salt` as its cache_salt, after any salt of
    the caller's own (kept, so that the caller's isolation holds too)."""
    if salt is None:
        return prompt
    prompt = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
    own = prompt.get("cache_salt")
    prompt["cache_salt"] = salt if not own else f"{own}|{salt}"
    return prompt
