"""The edit registry end to end: a tap's literals and a request's values, written into slots as
tapc/lang/edits.py says, run through the op it names, equal what the edit means (numpy)."""
import numpy as np
import pytest
import torch
from engine_toy import INTER, toy_plan

from tapc.lang.edits import EDITS, MAX_COLUMNS
from tapc.worker.buffers import ParamTables
from tapc.api.requests import TapRequest, check
from tapc.worker.layout import Layout
from tapc.kernels import edit, ops  # noqa: F401  registers torch.ops.tapc.*

POINT = "model.layers.1.mlp.up_proj.output"   # INTER wide
rng = np.random.default_rng(7)
V = rng.normal(size=INTER)


def expected(x: np.ndarray, action: str, v: dict) -> np.ndarray:
    """What each edit means, per row."""
    x = x.astype(np.float64).copy()
    if action == "add":
        return x + v["alpha"] * np.asarray(v["vector"])
    if action == "scale":
        return x * v["factor"]
    if action == "project_out":
        u = np.asarray(v["direction"]) / np.linalg.norm(v["direction"])
        return x - (x @ u)[:, None] * u
    cols = list(v["cols"])
    value = v.get("value", 0.0)
    x[:, cols] = np.broadcast_to(np.asarray(value, dtype=np.float64), (len(cols),))
    return x


CASES = [  # (tap action, request params, the edit's argument values)
    ("add(v, alpha=2.5)", {"v": V}, {"vector": V, "alpha": 2.5}),
    ("add(v, alpha=a)", {"v": V, "a": -0.5}, {"vector": V, "alpha": -0.5}),
    ("add([" + ", ".join(f"{c:.3f}" for c in V) + "])", {}, {"vector": np.round(V, 3), "alpha": 1.0}),
    ("scale(f)", {"f": 3.0}, {"factor": 3.0}),
    ("scale(0.25)", {}, {"factor": 0.25}),
    ("set([2, 9, 4], value=1.5)", {}, {"cols": [2, 9, 4], "value": 1.5}),
    ("set([2, 9], value=[1.5, -2])", {}, {"cols": [2, 9], "value": [1.5, -2.0]}),
    ("set(c, value=w)", {"c": [0, 23, 5], "w": [7.0]}, {"cols": [0, 23, 5], "value": 7.0}),
    ("set(c, value=w)", {"c": [0, 23], "w": [7.0, 8.0]}, {"cols": [0, 23], "value": [7.0, 8.0]}),
    ("set(c, value=-3.0)", {"c": [11]}, {"cols": [11], "value": -3.0}),
    ("set([1, 3], value=w)", {"w": 4.0}, {"cols": [1, 3], "value": 4.0}),
    ("zero(c)", {"c": list(range(MAX_COLUMNS // 4))}, {"cols": list(range(MAX_COLUMNS // 4))}),
    ("zero([0, 17])", {}, {"cols": [0, 17]}),
    ("project_out(d)", {"d": V}, {"direction": V}),
]


@pytest.mark.parametrize("action, params, values", CASES)
def test_op_on_written_slots_equals_the_edits_meaning(action, params, values):
    plan = toy_plan([f"{POINT} | {action}"], slots=4)
    layout = Layout(plan)
    (tap,) = layout.edits
    tables = ParamTables(layout.edits, 4, torch.device("cpu"))
    slot = 2
    ask = check(plan, TapRequest(params=params), "r")
    tables.write(slot, [0] if params else [], ask.params)
    x = torch.randn(6, INTER)
    rows = torch.tensor([slot, -1, slot, slot, -1, slot if params else 0], dtype=torch.int32)
    op = EDITS[tap.action]
    got, ref = x.clone(), x.clone()
    getattr(torch.ops.tapc, op.kernel)(got, None, rows, *tables.tables[0].values())
    getattr(edit, f"{op.kernel.rstrip('_')}_ref")(ref, None, rows, *tables.tables[0].values())   # its torch reference
    want = x.numpy().astype(np.float64).copy()
    edited = (rows >= 0).numpy()
    want[edited] = expected(want[edited], tap.action, values)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref)


def test_every_edit_op_lands_in_one_compiled_graph():
    """Dynamo inlines the patched forwards with each op the registry names, without a break."""
    from engine_toy import toy_buffers, ToyModel

    from tapc.worker.install import install

    taps = [f"model.layers.0.resid | {a}" for a in ("add(v, alpha=a)", "scale(0.5)", "set([1, 2], value=w)",
                                                   "zero(c)", "project_out(v)")]
    plan = toy_plan(taps)
    layout = Layout(plan)
    buffers = toy_buffers(layout, 64, 8)
    ask = check(plan, TapRequest(params={"v": V[:16], "a": 2.0, "w": [3.0, 4.0], "c": [0, 5]}), "r")
    buffers.params.write(1, list(range(len(layout.edits))), ask.params)
    buffers.table[len(layout.captures):, :5] = 1
    model = ToyModel()
    install(model, layout, buffers)
    ids, pos = torch.tensor([3, 1, 4, 1, 5]), torch.arange(5)
    eager = model(ids, pos)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)(ids, pos)
    torch.testing.assert_close(compiled, eager)
    assert not torch.equal(eager, ToyModel()(ids, pos)), "the edits changed nothing"
