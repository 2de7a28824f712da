"""`VLLM(model, taps=[...])`: a vLLM engine with taps compiled into its graphs.

    llm = VLLM("path/to/model", taps=["model.layers.*.resid", "model.layers.10.resid | add(steer, alpha=4.0)"])
    outs = llm.generate(prompts, SamplingParams(max_tokens=32),
                        taps=TapRequest(capture=["model.layers.*.resid"], params={"steer": v}))
    outs[0].taps["model.layers.3.resid"]     # [rows, hidden] on the CPU, rows as `positions` says

`generate` takes and returns what vLLM's `LLM.generate` does; each RequestOutput gets a
`taps` dict (empty when the request captured nothing). See docs/engine.md.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from tapc.engine.config import engine_kwargs
from tapc.engine.requests import TapRequest, to_wire
from tapc.engine.tables import expected_rows
from tapc.errors import EngineError, RequestError
from tapc.plan import TapPlan, build_plan

__all__ = ["VLLM", "TapRequest"]

# The plan sizes buffers and tables for these unless the caller sets them; the engine gets the
# same values (vLLM's own defaults depend on the GPU).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256


class VLLM:
    """vLLM's `LLM` with taps. `taps`: tap strings (see `tapc explain`); other keyword arguments
    go to `vllm.LLM` (prefix caching is turned off; see docs/engine.md)."""

    def __init__(self, model: str, taps: Sequence[str], **kwargs):
        from vllm import LLM

        kwargs.setdefault("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        kwargs.setdefault("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        self.plan: TapPlan = build_plan(model, list(taps), max_num_batched_tokens=kwargs["max_num_batched_tokens"],
                                        max_num_seqs=kwargs["max_num_seqs"])
        self.llm = LLM(model=model, **engine_kwargs(self.plan, kwargs))

    def generate(self, prompts, sampling_params=None, *, taps: TapRequest | Sequence[TapRequest | None] | None = None,
                 **kwargs) -> list:
        """vLLM's `generate`, with `taps`: one `TapRequest` for every prompt, or one per prompt
        (None: untapped). A request asking for something the plan lacks raises `RequestError`
        before anything is submitted."""
        from vllm import SamplingParams

        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        n = len(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * n
        asks = list(taps) if isinstance(taps, Sequence) else [taps] * n
        if len(params) != n or len(asks) != n:
            raise RequestError(f"{n} prompts but {len(params)} sampling params and {len(asks)} tap requests")
        wires: list[dict | None] = []
        for i, (sp, ask) in enumerate(zip(params, asks)):
            wire = None if ask is None else to_wire(self.plan, ask, f"request {i}")
            if wire is not None and (wire["capture"] or wire["params"]):
                if sp.n != 1:
                    raise RequestError(f"request {i}: taps with n={sp.n} samples per prompt are not supported; "
                                       "repeat the prompt instead")
                sp = sp.clone()
                sp.extra_args = {**(sp.extra_args or {}), "tapc": wire}
                params[i] = sp
            else:
                wire = None
            wires.append(wire)
        outs = self.llm.generate(prompts, params, **kwargs)
        wanted = [w["id"] for w in wires if w is not None and w["capture"]]
        got = self.llm.collective_rpc("tapc_collect", args=(wanted,))[0] if wanted else {}
        for out, wire in zip(outs, wires):
            out.taps = {} if wire is None or not wire["capture"] else _assemble(out, wire, got[wire["id"]])
        return outs


def _assemble(out, wire: dict, result: dict) -> dict[str, torch.Tensor]:
    """Per key `[rows, width]`, rows in position order; rows of a step vLLM ran after the
    request's last token (async scheduling) are dropped."""
    if "error" in result:
        raise RequestError(f"request {out.request_id}: {result['error']}")
    generated = len(out.outputs[0].token_ids)
    keep = expected_rows(wire["positions"], len(out.prompt_token_ids), generated)
    taps: dict[str, torch.Tensor] = {}
    for store in result["stores"]:
        keys, width, dtype = store["keys"], store["width"], getattr(torch, store["dtype"])
        parts = [_tensor(c, dtype).view(-1, len(keys), width) for c in store["chunks"]]
        if store["rows"] < keep:
            raise EngineError(f"request {out.request_id}: {store['rows']} rows captured for {keep} positions")
        block = (torch.cat(parts) if parts else torch.empty(0, len(keys), width, dtype=dtype))[:keep]
        taps.update({k: block[:, j] for j, k in enumerate(keys)})
    return taps


def _tensor(raw, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over bytes from the engine (read-only bytes across processes; cat copies them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
