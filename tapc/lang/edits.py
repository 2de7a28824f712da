"""The edit ops in one table: arguments and kinds, value checks, slot tables, kernel.

Everything that knows what an edit means reads this module: the parser (literals),
the resolver (literals against the point's width), the request check (parameter values), the
engine's parameter tables (their sizes, and how a value is written into a request's slot) and
the op an edit calls, in the graph and on the logits. It imports neither torch nor vLLM, so
that `tapc explain` stays light; each kernel's torch reference is `tapc.kernels.edit.<kernel>_ref`.

An edit's op is `torch.ops.tapc.<kernel>(x, b, slot, *tables)`: `slot[i]` names the request
slot of row i (-1: leave the row alone) and each table is `[slots, ...]`, one row per slot
(docs/kernels.md). A table holds one argument's value: a literal in every slot, or the value a
request binds in that request's slot. `patch` also reads the runner's positions, after `slot`:
its rows are the request's own, each for one position.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from numbers import Real

import numpy as np

from tapc.lang.quoted import shown

REQUIRED = object()
# Which rows of its request an edit (or a capture) covers; docs/engine.md.
POSITIONS = ("all", "prompt", "generated", "last")
# Per-request column lists (set/zero with a `columns` parameter) fill a fixed-width slot table.
MAX_COLUMNS = 64

# patch(src, rows=k): a slot holds up to k rows (k sizes its table: slots x k x width).
MAX_PATCH_ROWS = 256
# Positions travel and fill the tables as int32.
MAX_POSITION = 2**31 - 1
# Values fill float32 tables: past this they would be inf there.
F32_MAX = float(np.finfo(np.float32).max)

# Every edit also takes `at=`: which rows of its request to edit.
AT = ("at", "positions", "all")
# The action that runs a compiled function (tapc/lang/functions.py); its tables are its parameters'.
CALL = "call"
# The logit lens (`| lens(k=10)`): a point's rows through the final norm and the unembedding,
# their k best tokens; k sizes two captures and the kernel's candidates (tapc/kernels/lens.py).
LENS = "lens"
LENS_K = ("k", 10)
MAX_LENS_K = 64
# Attention patterns (`<attention>.pattern`, tapc/kernels/pattern.py): a capture whose row is
# [heads, keys]; `capture(heads=[...], keys=N)` bounds its width (keys: the engine's
# max_model_len unless given).
PATTERN = "pattern"
PATTERN_ARGS = ("heads", "keys")
MAX_PATTERN_KEYS = 1 << 20


@dataclass(frozen=True)
class EditOp:
    """One edit: its arguments ((name, kind, default), in positional order), the `tapc::` op it
    runs, the arguments whose values fill that op's tables (in the op's order), and constants
    for tables no argument fills."""

    name: str
    args: tuple[tuple[str, str, object], ...]
    kernel: str
    tables: tuple[str, ...]
    constants: tuple[tuple[str, float], ...] = ()
    unit: bool = False            # vectors are normalised to unit length when written

    def kinds(self) -> dict[str, str]:
        return {name: kind for name, kind, _ in self.args + (AT,)}


EDITS: dict[str, EditOp] = {
    "add": EditOp("add", (("vector", "vector", REQUIRED), ("alpha", "scalar", 1.0)), "add_", ("vector", "alpha")),
    "scale": EditOp("scale", (("factor", "scalar", REQUIRED),), "scale_", ("factor",)),
    "set": EditOp("set", (("cols", "columns", REQUIRED), ("value", "values", REQUIRED)), "set_cols_",
                  ("cols", "value")),
    "zero": EditOp("zero", (("cols", "columns", REQUIRED),), "set_cols_", ("cols", "value"),
                   constants=(("value", 0.0),)),
    "project_out": EditOp("project_out", (("direction", "vector", REQUIRED),), "project_out_", ("direction",),
                          unit=True),
    # The request's rows replace its activation at their positions (activation patching); the
    # op reads the row's position, and a slot's rows and their positions.
    "patch": EditOp("patch", (("src", "rows", REQUIRED), ("rows", "count", 1)), "patch_", ("src", "src_at")),
}
# op -> ((argument, kind, default), ...), as the parser binds them.
SIGNATURES = {op: e.args for op, e in EDITS.items()}


# ----------------------------------------------------------------------------- checks


def check_literal(kind: str, value):
    """A literal as written in a tap (not a parameter name), checked by kind; returns it in its
    plan form. Raises ValueError with what is wrong (the caller names the tap and argument)."""
    if kind == "positions":
        if value not in POSITIONS:
            raise ValueError(f"must be one of {', '.join(POSITIONS)}")
        return value
    if kind == "scalar" and not isinstance(value, (int, float)):
        raise ValueError("must be a number or a parameter name")
    if kind == "rows":
        raise ValueError("must be a parameter name: each request binds its own rows (their positions and values)")
    if kind == "count" and not (isinstance(value, int) and 1 <= value <= MAX_PATCH_ROWS):
        raise ValueError(f"must be a whole number of rows in 1..{MAX_PATCH_ROWS}")
    if kind == "columns":
        value = value if isinstance(value, tuple) else (value,)
        if not value or not all(isinstance(v, int) and v >= 0 for v in value):
            raise ValueError("must be column indices (a non-negative integer or a list of them) or a parameter name")
        if len(set(value)) != len(value):
            raise ValueError("names a column twice")
    if kind == "values" and isinstance(value, tuple) and not all(isinstance(v, (int, float)) for v in value):
        raise ValueError("must be a number, a list of numbers, or a parameter name")
    if kind == "vector" and not (isinstance(value, tuple) and value and all(isinstance(v, (int, float)) for v in value)):
        raise ValueError("must be a parameter name (a vector bound per request or per engine) or a list of numbers")
    return value


def check_at_point(op: str, literals: dict, width: int) -> None:
    """An edit's literal arguments (name -> value; parameters left out) against the width of the
    point it edits. Raises ValueError naming the op and argument."""
    kinds = EDITS[op].kinds()
    for name, value in literals.items():
        kind = kinds[name]
        if kind == "vector" and len(value) != width:
            raise ValueError(f"{op}() {name} has {len(value)} numbers but the point is {width} wide")
        if kind == "columns":
            over = [c for c in value if c >= width]
            if over:
                raise ValueError(f"{op}() columns {over} are past the point's width {width}")
    why = set_lengths(literals.get("cols"), literals.get("value"))
    if why:
        raise ValueError(f"{op}() {why}")


def set_lengths(cols, values) -> str | None:
    """set(cols, value): a list of values needs one value per column. None when fine or unknown."""
    if cols is None or values is None or isinstance(values, (int, float)):
        return None
    if len(values) not in (1, len(cols)):
        return f"gives {len(values)} values for {len(cols)} columns"
    return None


def check_param(kind: str, value, width: int):
    """A value a request binds to a parameter of `kind` at a point `width` wide; returns its wire
    form (vectors as float32 bytes: msgpack sends them as one binary field, not thousands of
    Python floats). Raises ValueError with what is wrong."""
    if kind == "vector":
        arr = _float32(value)
        if arr is None:
            raise ValueError(f"must be {width} numbers, got {shown(value)}")
        if arr.ndim != 1 or arr.shape[0] != width:
            raise ValueError(f"must be {width} numbers, got shape {tuple(arr.shape)}")
        if not np.isfinite(arr).all():
            raise ValueError(f"has non-finite entries in float32 (its range is ±{F32_MAX:.4g}), got {shown(value)}")
        return arr.tobytes()
    if kind == "scalar":
        if not _finite(value):
            raise ValueError(f"must be a finite number in float32 (its range is ±{F32_MAX:.4g}), got {shown(value)}")
        return float(value)
    if kind == "rows":
        return _checked_patch(value, width)
    if kind == "columns":
        cols = [value] if isinstance(value, (int, np.integer)) else listed(value)
        if not cols or len(cols) > MAX_COLUMNS or len(set(cols)) != len(cols) or \
                not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) and 0 <= c < width for c in cols):
            raise ValueError(f"must be 1..{MAX_COLUMNS} distinct column indices in 0..{width - 1}, got {shown(value)}")
        return [int(c) for c in cols]
    vals = [value] if isinstance(value, Real) else listed(value)
    if not vals or not all(_finite(v) for v in vals):
        raise ValueError(f"must be a number or a list of numbers, finite in float32 (its range is ±{F32_MAX:.4g}), "
                         f"got {shown(value)}")
    return [float(v) for v in vals]


def _checked_patch(value, width: int) -> bytes:
    """patch() rows, `{"positions": [p, ...], "rows": [n, width]}`, in their wire form: n and the
    n positions as int32, then the rows as float32 (`patch_rows` reads it back)."""
    if not isinstance(value, Mapping) or set(value) != {"positions", "rows"}:
        raise ValueError(f'must be {{"positions": [p, ...], "rows": [n, {width}] numbers}}, got {shown(value)}')
    pos = value["positions"]
    # no more than a slot's rows are read: a range(10**9) is not made a list first
    pos = listed(pos, MAX_PATCH_ROWS + 1)
    if not pos or len(pos) > MAX_PATCH_ROWS or len(set(pos)) != len(pos) or \
            not all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) and 0 <= p <= MAX_POSITION for p in pos):
        raise ValueError(f"positions must be distinct non-negative token positions (1..{MAX_PATCH_ROWS} of them, "
                         f"each up to {MAX_POSITION}), got {shown(value['positions'])}")
    rows = value["rows"]
    arr = _float32(rows)
    if arr is None:
        raise ValueError(f"rows must be [{len(pos)}, {width}] numbers, got {shown(rows)}")
    if arr.shape != (len(pos), width):
        raise ValueError(f"rows must be [{len(pos)}, {width}] (a row per position), got shape {tuple(arr.shape)}")
    if not np.isfinite(arr).all():
        raise ValueError(f"rows have non-finite entries in float32 (its range is ±{F32_MAX:.4g})")
    return patch_wire(pos, arr)


def patch_rows(wire: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(positions [n] int32, rows [n, width] float32) of patch() rows in their wire form."""
    n = int(np.frombuffer(wire, dtype=np.int32, count=1)[0])
    return (np.frombuffer(wire, dtype=np.int32, count=n, offset=4),
            np.frombuffer(wire, dtype=np.float32, offset=4 * (n + 1)).reshape(n, -1))


def patch_wire(positions, rows: np.ndarray) -> bytes:
    """patch() rows in their wire form (a GPU's columns of them under tensor parallelism)."""
    return np.asarray([len(positions), *positions], dtype=np.int32).tobytes() + rows.astype(np.float32).tobytes()


def _finite(v) -> bool:
    """A number (not a flag) that float32, the tables' type, holds finite: 1e39 is not."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, Real):
        return False
    try:
        return math.isfinite(v) and abs(v) <= F32_MAX
    except OverflowError:   # an int past float64
        return False


def listed(value, most: int | None = None) -> list | None:
    """The items of a list (up to `most` of them: no more are read); None for what is not a
    list: a number, text, bytes or a mapping (which iterate too)."""
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, bytearray, Mapping)):
        return None
    return list(islice(value, most))


def _float32(value) -> np.ndarray | None:
    """Numbers (nested lists, a numpy array or a tensor) as the float32 the tables hold, where
    an entry past float32 is inf; None for what is not numbers: flags (True is no number), text,
    ragged lists, None entries."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        value = value.float().numpy() if value.is_floating_point() else value.numpy()   # numpy has no bfloat16
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError):   # ragged, or ints past int64 in an array of its own
        return None
    if arr.dtype.kind not in "iuf" or isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value):
        return None
    with np.errstate(over="ignore"):   # past float32 is inf, refused by the caller
        return arr.astype(np.float32)


# ----------------------------------------------------------------------------- slot tables


@dataclass(frozen=True)
class Table:
    """One parameter table of an edit: `[slots, *shape]` of `dtype`.

    share: tables of a named vector or scalar parameter are one table for every edit that uses
    the name (a glob `add(steer)` over 32 layers holds one `steer` table): their key. None: the
    edit's own table. literal: the tap fixes its value, written in every slot at allocation.
    """

    arg: str                        # the argument whose value it holds
    shape: tuple[int, ...]
    dtype: str                      # "float32" | "int32"
    share: tuple | None
    literal: bool

    @property
    def nbytes_per_slot(self) -> int:
        return math.prod(self.shape) * 4   # float32 and int32 alike


def tables(action: str, args, width: int) -> tuple[Table, ...]:
    """The tables an edit reads, in its op's argument order. `args`: the tap's `Arg`s. A
    compiled function's (`call`) are its declared parameters', scalars and vectors alike."""
    if action == CALL:
        return tuple(Table(a.name, () if a.kind == "scalar" else (width,), "float32",
                           None if a.param is None else (a.param, False), a.param is None)
                     for a in args if a.name != AT[0])
    if action == "patch":   # a slot's rows, and their positions (-1: none), shared by parameter name
        by_name = {a.name: a for a in args}
        k, src = by_name["rows"].value, by_name["src"].param
        return (Table("src", (k, width), "float32", (src, "rows", k), False),
                Table("src_at", (k,), "int32", (src, "positions", k), False))
    op = EDITS[action]
    by_name = {a.name: a for a in args}
    kinds = op.kinds()
    out = []
    for name in op.tables:
        arg = by_name.get(name)
        param = arg.param if arg is not None else None
        kind = kinds[name] if name in kinds else "values"
        if kind == "vector":
            shape: tuple[int, ...] = (width,)
        elif kind == "scalar":
            shape = ()
        else:  # columns, and the values set writes there: a slot holds up to this many
            cols = by_name["cols"]
            shape = (MAX_COLUMNS if cols.param else len(cols.value),)
        share = (param, op.unit) if param is not None and kind in ("vector", "scalar") else None
        literal = param is None and (kind != "values" or by_name["cols"].param is None)
        out.append(Table(name, shape, "int32" if kind == "columns" else "float32", share, literal))
    return tuple(out)


def slot_row(action: str, table: Table, values: dict) -> np.ndarray:
    """What one slot of `table` holds, as a numpy array of its shape and dtype. `values`: the
    edit's argument values by name (literals, and a request's wire values for its parameters)."""
    if action == CALL:
        value = values[table.arg]
        return np.frombuffer(value, dtype=np.float32).copy() if isinstance(value, bytes) else np.asarray(value, np.float32)
    if action == "patch":
        k = table.shape[0]
        pos, rows = patch_rows(values["src"])
        if table.arg == "src_at":
            return np.concatenate([pos, np.full(k - len(pos), -1, np.int32)])
        return np.concatenate([rows, np.zeros((k - len(rows), rows.shape[1]), np.float32)])
    op = EDITS[action]
    value = values.get(table.arg, dict(op.constants).get(table.arg))
    kind = op.kinds().get(table.arg, "values")
    if kind == "vector":
        v = np.frombuffer(value, dtype=np.float32) if isinstance(value, bytes) else np.asarray(value, np.float32)
        norm = float(np.linalg.norm(v.astype(np.float64))) if op.unit else 0.0
        return (v / norm).astype(np.float32) if norm > 0 else v.astype(np.float32)
    if kind == "scalar":
        return np.asarray(value, dtype=np.float32)
    (n,) = table.shape
    if kind == "columns":
        cols = list(value)
        return np.asarray(cols + [-1] * (n - len(cols)), dtype=np.int32)
    # values: one per column; a single value is every column's (of the columns the edit names)
    given = [value] if isinstance(value, (int, float)) else list(value)
    cols = values.get("cols")
    m = len(cols) if cols is not None else n
    given = given * m if len(given) == 1 else given
    return np.asarray(given + [0.0] * (n - len(given)), dtype=np.float32)

