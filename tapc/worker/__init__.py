"""Everything that runs inside vLLM's worker: the only part of tapc that touches vLLM's runner
internals (docs/architecture.md walks the route).

- `worker`: the vLLM worker class that installs all of it after the model loads, through
  `assemble`: the one wiring of the taps, the step components and the patches, which the CPU
  toy engine (tests/support/engine_toy.py) uses too.
- `layout`: this GPU's part of the plan's in-graph taps, as table rows and capture groups.
- `buffers`: the device tables and capture pools; `copyout`: a step's captured rows to host memory
  (its route, one table), through `segmentcopy` (one step's segments into their requests' host
  storage) and `memcpy` (the CUDA driver's batched copy and events).
- `install`, `source`: patched module forwards, so the tap ops land in the compiled graphs;
  `calls`: a compiled function's call at its point, traced with the model.
- `patches`: every change to vLLM's and torch's objects, each undoable.
- `runner`: the step loop, over the step components (`component`): `tables` (the row tables,
  filled by `fill` / `fill_jit`, repeated and ringed by `rings`, copied out by `copyout`),
  `slots` (the edits' parameter slots), `prefixrows` (kept rows of shared prompts), `switch`
  (tap kernels off where no row asks), `points` (`logits`, `samples`, Python blocks, run by
  `runtime`).
- `runner_v2`, `runner_v1`: the adapters of vLLM's V2 and V1 model runners; `step`: a step's
  batch as a plain value.
- `records`, `storage`: what the worker keeps per request; `graphs`, `cugraph`: CUDA graphs split
  at Python blocks, and the driver calls that switch graph nodes.
"""
