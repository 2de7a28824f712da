"""Triton kernels for tapc's in-graph taps, their torch references, and the `tapc::` ops.

Importing this package registers the ops (`torch.ops.tapc.*`), so any process that loads
tapc's kernels can run graphs that call them. This package imports nothing else of tapc.

- `capture`: read rows of an activation into a buffer (`capture`, `capture_pair`, `capture_trio`, `capture_sum`).
- `edit`: edit rows in place (`add_`, `scale_`, `set_cols_`, `project_out_`).
- `ops`: the custom ops, `set_boundary_handler` for `tapc::boundary`, and `set_launch_observer`
  (told each op's row tables after its launch: how the engine finds the ops' graph nodes).
See docs/kernels.md for the tables the engine fills.
"""
if __name__ == "tapc.kernels":
    from . import ops
    from .ops import set_boundary_handler, set_launch_observer

    __all__ = ["ops", "set_boundary_handler", "set_launch_observer"]
# Otherwise this folder was found as a top-level `kernels` (the repo root on sys.path), e.g. by
# transformers probing for Hugging Face's `kernels` package: register nothing (the ops belong
# to `tapc.kernels`, and a second registration of the namespace would fail); having no
# __version__, it reads as "not installed" to such probes.
