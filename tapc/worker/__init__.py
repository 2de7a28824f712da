"""vLLM wiring: the only part of tapc that touches vLLM's runner internals.

- `requests`: what one request asks for (`TapRequest`), checked against a plan, and its wire form.
- `positions`: which token positions a request's `positions` (or an edit's `at=`) covers.
- `layout`: the plan's in-graph taps as table rows, captures grouped into pools.
- `records`, `storage`, `slots`: what the worker keeps per request (its captures' host
  storage, its parameter slot).
- `fill`: the host side of each step: the row tables from the batch layout.
- `memcpy`: the step's capture copies to host memory.
- `buffers`: the device side: row tables, capture pools, per-slot parameter tables, copy-out.
- `install`: patch module forwards so the tap ops land in the compiled graphs.
- `step`: the batch of one step as a plain value (`StepBatch`).
- `runner`: the per-request and per-step bookkeeping a runner adapter calls each step;
  `runner_v2`, `runner_v1`: that adapter for vLLM's V2 and V1 model runners.
- `protocol`: what travels between the API and the worker (typed values, their wire form).
- `patches`: every change to vLLM's and torch's objects (the adapter's runner methods, sampler class, the
  boundary handler, the CUDA graph class while capturing), each undoable.
- `worker`: the vLLM worker class that installs all of it after the model loads.
- `config`: the engine arguments a plan needs (compilation, worker class, parallel sizes).
See docs/engine.md.
"""
