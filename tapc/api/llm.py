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

from collections.abc import Sequence

from tapc.api.engine import Engine
from tapc.api.engine_args import require_cuda
from tapc.api.requests import TapRequest
from tapc.api.session import Taps, TapSession
from tapc.api.specs import spec_functions
from tapc.errors import EngineError
from tapc.lang.blockpaths import import_blocks
from tapc.plan.tapplan import TapPlan

__all__ = ["VLLM", "TapRequest", "Taps"]


class VLLM:
    """vLLM's `LLM` with taps. `taps`: tap strings (see `tapc explain`); `blocks`: Python blocks
    by name (docs/blocks.md); `functions`: compiled functions by name, which `| call(name)` taps
    run inside the graphs (docs/blocks.md); `params`: engine-wide parameter values, used by every request that
    does not pass its own; `capture_dtype`: dtype captures are stored in (default: the model's);
    `capture_memory_gib`: host memory for captures each GPU makes and pins at start (default 0:
    as requests need it, which stalls the step that first needs each GiB for about a second;
    docs/engine.md); `capture_memory_keep_gib`: host memory for captures each GPU keeps once
    idle, what a burst grew past it going back (default: all of it, for the engine's life);
    `prefix_rows_gib`: host memory for captured rows of shared prompt blocks, which
    lets captures of prompt rows read the prefix cache (default 0: they compute every prompt row;
    one GPU; tapc/worker/prefixrows.py). Other keyword arguments go to `vllm.LLM`. Prefix caching stays as vLLM sets it: requests that
    capture prompt rows or edit are kept apart from cached KV by tapc/api/prefix.py.

    `close()`, or leaving `with VLLM(...) as llm:`, stops it."""

    closed = False

    def __init__(self, model: str, taps: Sequence[str], *, blocks: dict | None = None, params: dict | None = None,
                 capture_dtype: str | None = None, functions: dict | None = None, **kwargs):
        from vllm import LLM

        self.plan, self.session, engine_args = setup(model, taps, blocks, params, capture_dtype, kwargs, functions)
        self.llm = LLM(model=model, **engine_args)
        self.session.max_model_len = self.llm.model_config.max_model_len
        if blocks:
            import cloudpickle

            self.llm.collective_rpc("tapc_set_blocks", args=(cloudpickle.dumps(dict(blocks)),))

    @classmethod
    def from_spec(cls, spec, **overrides) -> "VLLM":
        """An engine from a YAML spec (a path or a loaded `Spec`): its model, engine arguments,
        taps, parameters (tensors loaded from their files) and capture dtype. `overrides` are
        more keyword arguments (e.g. blocks=, attention_backend=)."""
        model, taps, kwargs = spec_arguments(spec, overrides)
        return cls(model, taps, **kwargs)

    def generate(self, prompts, sampling_params=None, *, taps: TapRequest | Sequence[TapRequest | None] | None = None,
                 **kwargs) -> list:
        """vLLM's `generate`, with `taps`: one `TapRequest` for every prompt, or one per prompt
        (None: untapped). A request asking for something the plan lacks raises `RequestError`
        before anything is submitted (as vLLM does for a bad prompt). What fails once requests
        run (no room for a request's captures, a raising block) fails that request only: its
        `out.error` says why, and every other request's results come back."""
        if self.closed:
            raise EngineError("this engine was closed")
        prompts, prepared = self.session.prepare_batch(prompts, sampling_params, taps)
        self._give_back()
        outs = self.llm.generate(prompts, [p.params for p in prepared], **kwargs)
        wanted = self.session.wanted(prepared)
        # one reply per worker (several under tensor / pipeline parallelism): the session merges them
        replies = self.llm.collective_rpc("tapc_collect", args=(wanted,)) if wanted else None
        return self.session.finish_batch(outs, prepared, replies)

    def close(self) -> None:
        """Stop the engine: its workers remove their capture files and vLLM's engine core exits,
        giving back its GPU memory, before this returns. Captures already returned stay
        readable (each tensor keeps its memory until dropped). Closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            self.llm.collective_rpc("tapc_close")
        except EngineDeadError:   # its processes are gone: the next engine sweeps their files
            pass
        finally:
            # vLLM's LLM has no method of its own for this
            self.llm.llm_engine.engine_core.shutdown()
            self.session.arena.close()

    def __enter__(self) -> "VLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _give_back(self) -> None:
        """Tell the worker which capture chunks the caller has dropped since the last call."""
        chunks = self.session.released()
        if chunks:
            self.llm.collective_rpc("tapc_release", args=(chunks,))


def setup(model: str, taps: Sequence[str], blocks: dict | None, params: dict | None, capture_dtype: str | None,
          kwargs: dict, functions: dict | None = None) -> tuple[TapPlan, TapSession, dict]:
    """What a tapped engine (offline or async) needs before vLLM starts: the plan, the session
    (blocks= and params= checked against the plan) and vLLM's engine arguments."""
    require_cuda()
    engine, args = Engine.build(model, taps, kwargs, capture_dtype=capture_dtype, functions=functions)
    caching = args.get("enable_prefix_caching") is not False   # vLLM's default (None) is on
    return engine.plan, engine.session(params, blocks, prefix_caching=caching), args


def spec_arguments(spec, overrides: dict) -> tuple[str, list[str], dict]:
    """(model, taps, keyword arguments) of an engine from a YAML spec (a path or a `Spec`)."""
    from tapc.lang.specfile import Spec, load_spec

    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    params = spec.param_values()
    blocks = import_blocks(spec.blocks, f"{spec.path}: blocks") or None   # blocks= in overrides wins
    return spec.model, [t.text for t in spec.taps], {"params": params or None, "capture_dtype": spec.capture.dtype,
                                                     "capture_memory_gib": spec.capture.memory_gib,
                                                     "capture_memory_keep_gib": spec.capture.memory_keep_gib,
                                                     "blocks": blocks, "functions": spec_functions(spec) or None,
                                                     **spec.engine, **overrides}
