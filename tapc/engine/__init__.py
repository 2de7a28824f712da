"""vLLM wiring: the only part of tapc that touches vLLM's runner internals.

- `requests`: what one request asks for (`TapRequest`), checked against a plan, and its wire form.
- `tables`: the host side of each step: which rows go where, per-request capture storage.
- `buffers`: the device side: row tables, capture pools, per-slot parameter tables, copy-out.
- `install`: patch module forwards so the tap ops land in the compiled graphs.
- `runner`: hooks on vLLM's V2 model runner that fill the tables each step.
- `patches`: every change to vLLM's and torch's objects (runner methods, sampler class, the
  boundary handler, the CUDA graph class while capturing), each undoable.
- `worker`: the vLLM worker class that installs all of it after the model loads.
- `config`: the engine arguments a plan needs (compilation, prefix caching, worker class).
See docs/engine.md.
"""
