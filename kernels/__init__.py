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
else:
    # This folder was found as a top-level `kernels`: the repo root is on sys.path (`python -m
    # pytest` or a script run from a checkout), and something imported Hugging Face's `kernels`
    # package, which transformers >= 5.25 requires and imports. Register nothing here (the ops
    # belong to `tapc.kernels`; a second registration of the namespace would fail) and hand the
    # importer that package where it is installed further along sys.path: the import statement
    # returns what sys.modules holds once this module has run.
    import importlib.machinery
    import importlib.util
    import sys
    from pathlib import Path

    _root = Path(__file__).resolve().parent.parent
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if Path(p or ".").resolve() != _root])
    if _spec is not None and _spec.loader is not None:
        _real = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _real
        _spec.loader.exec_module(_real)
