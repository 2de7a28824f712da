"""Every change tapc makes to objects it does not own (vLLM's runner and sampler, torch, the
`tapc::boundary` handler), made here, each owned by a `Patch` that can undo it.

The worker applies them at load (assemble.py, `apply`), after the taps are installed
in the model (install.py patches forwards of that model's own module instances: part of the
model, not listed here): first the runner's step methods, which become its adapter's
(`adapter.METHODS`: `execute_model` and `prepare_inputs` on V2, runner_v2.py; `execute_model`,
`_model_forward` and `_dummy_run` on V1, runner_v1.py) and call the originals around the
runner-independent hooks (runner.py); then what each step component declares it needs
(`StepComponent.patches`, component.py), in the components' order:
- `PrefixRows` (prefixrows.py): vLLM's `KVCacheManager.get_computed_blocks` reads the prefix
  cache of a capture of prompt rows only as far as its kept rows go (`cache_lookup_patch`);
- `Switch` (switch.py): the tap ops ask it whether to launch at all outside graphs
  (tapc/kernels/ops.py `_idle`), and, with its driver, `capture_model` captures `SwitchedGraph`s,
  with the tap ops' launch observer set so that each graph learns its tap nodes;
- `EnginePoints` (points.py): the sampler's class becomes a subclass that runs the engine points
  around sampling (`sampler_patch`: `logits` before, `samples` after); the process's
  `tapc::boundary` handler (tapc/kernels/ops.py) becomes the block runtime; with blocks in the
  forward, the runner's `capture_model` captures `SegmentedGraph`s (graphs.py `breaking`).
`capture_patch` swaps `torch.cuda.CUDAGraph` only while `capture_model` runs. `Patches.undo`
puts everything back, last applied first.
"""
from __future__ import annotations

import contextlib
import functools

import torch

_MISSING = object()


class Patch:
    """`owner.name = value` until `undo`; also a context manager for a patch held while a call
    runs. Where `owner` had no attribute of its own (a method of its class), undo deletes ours."""

    def __init__(self, owner, name: str, value):
        self.owner, self.name, self.value = owner, name, value
        self.original = _MISSING

    def apply(self) -> "Patch":
        own = getattr(self.owner, "__dict__", {})
        self.original = type(self.owner) if self.name == "__class__" else own.get(self.name, _MISSING)
        setattr(self.owner, self.name, self.value)
        return self

    def undo(self) -> None:
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)

    def __enter__(self) -> "Patch":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.undo()


class Patches:
    """The patches of one worker, in the order they were applied."""

    def __init__(self):
        self.applied: list[Patch] = []

    def add(self, patch: Patch) -> Patch:
        self.applied.append(patch.apply())
        return patch

    def undo(self) -> None:
        while self.applied:
            self.applied.pop().undo()


def apply(runner, adapter, components) -> Patches:
    """Route `runner`'s step (vLLM's V2 or V1 model runner, or a stand-in with its methods) through
    `adapter` (runner_v2.V2Adapter, runner_v1.V1Adapter), then make the changes each of
    `components` (component.py `StepComponent.patches`) needs, in their order."""
    patches = Patches()
    for name in adapter.METHODS:
        patches.add(Patch(runner, name, getattr(adapter, name)))
    for component in components:
        for patch in component.patches(runner):
            patches.add(patch)
    return patches


def sampler_patch(sampler, points) -> Patch:
    """Run `points` around vLLM's sampler: logits before sampling, sampled ids after. V2 calls
    it as `sampler(logits, input_batch)`, V1 as `sampler(logits=..., sampling_metadata=...)`."""
    base = type(sampler)

    class TappedSampler(base):
        def __call__(self, logits, *args, **kwargs):
            points.on_logits(logits)
            out = base.__call__(self, logits, *args, **kwargs)
            points.on_samples(out.sampled_token_ids)
            return out

    TappedSampler.__name__ = f"Tapped{base.__name__}"
    return Patch(sampler, "__class__", TappedSampler)


def cache_lookup_patch(prefix_rows, manager_class=None) -> Patch:
    """vLLM's `KVCacheManager.get_computed_blocks` (the scheduler's prefix-cache lookup, in this
    process: vLLM's single-process executor runs the worker beside its scheduler) limited, for a
    request that captures prompt rows, to the leading blocks whose captured rows `prefix_rows`
    keeps: the lookup sees only those blocks' hashes. `manager_class`: vLLM's, unless a stand-in."""
    if manager_class is None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager as manager_class
    lookup = manager_class.get_computed_blocks

    @functools.wraps(lookup)
    def get_computed_blocks(self, request):
        sp = request.sampling_params
        n = prefix_rows.limit(request.request_id, request.block_hashes, sp.extra_args if sp is not None else None)
        if n is None:
            return lookup(self, request)
        if self.num_kv_cache_groups != 1:   # hashes of several block sizes: read nothing
            n = 0
        hashes = request.block_hashes
        request.block_hashes = hashes[:n]
        try:
            return lookup(self, request)
        finally:
            request.block_hashes = hashes

    return Patch(manager_class, "get_computed_blocks", get_computed_blocks)


def capture_patch(runner, graph_class: type, during: Patch | None = None) -> Patch:
    """`runner.capture_model` that captures `graph_class`es: vLLM's graph code makes its graphs
    with `torch.cuda.CUDAGraph()`, so the class is swapped for the capture and put back after,
    also when it raises (capture runs once, at engine start, on one thread); `during` is held
    for the capture too."""
    capture = runner.capture_model

    @functools.wraps(capture)
    def capture_model(*args, **kwargs):
        with Patch(torch.cuda, "CUDAGraph", graph_class), during or contextlib.nullcontext():
            return capture(*args, **kwargs)

    return Patch(runner, "capture_model", capture_model)
