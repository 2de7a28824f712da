"""Triton kernels for tapc's in-graph taps, their torch references, and the `tapc::` ops.

Importing this package registers the ops (`torch.ops.tapc.*`), so any process that loads
tapc's kernels can run graphs that call them. This package imports nothing else of tapc.

- `capture`: read rows of an activation into a buffer (`capture`, `capture_pair`, `capture_trio`, `capture_sum`).
- `edit`: edit rows in place (`add_`, `scale_`, `set_cols_`, `project_out_`).
- `lens`: the logit lens, a point's rows through the final norm and the unembedding, top k.
- `pattern`: attention patterns, a query row's softmax weights over its request's keys in the paged KV cache.
- `ops`: the custom ops, `set_boundary_handler` for `tapc::boundary`, and `set_launch_observer`
  (told each op's row tables after its launch: how the engine finds the ops' graph nodes).
- `common`: what the launchers share: when Triton runs, block sizes, argument checks.
See docs/kernels.md for the tables the engine fills.
"""
from . import ops
from .ops import set_boundary_handler, set_launch_observer

__all__ = ["ops", "set_boundary_handler", "set_launch_observer"]
