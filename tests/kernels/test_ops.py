"""The tapc:: custom ops: schemas, dispatch, torch.compile, CUDA-graph replay, boundary."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import (
    DEVICE, EXTRA, ON_GPU, SLOTS, assert_close, dst_table, randn, seed, slot_table,
)
from torch._inductor.utils import run_and_get_code

import tapc.kernels  # noqa: F401  (registers the ops)
from tapc.kernels import capture as capture_kernels
from tapc.kernels import common, ops
from tapc.kernels import edit as edit_kernels
from tapc.kernels.capture import capture_ref, capture_sum_ref
from tapc.kernels.edit import add_ref, project_out_ref, scale_ref, set_cols_ref

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

NUM_COLS = 3


@dataclasses.dataclass
class Tables:
    """Everything the engine would allocate once and refill before each step."""

    dst: torch.Tensor
    slot: torch.Tensor
    vec: torch.Tensor
    alpha: torch.Tensor
    factor: torch.Tensor
    cols: torch.Tensor
    vals: torch.Tensor
    dirs: torch.Tensor
    out: torch.Tensor  # fp32 capture of the edited rows
    out_sum: torch.Tensor  # capture of h + r
    out_half: torch.Tensor  # capture of the first half of the columns

    @classmethod
    def new(cls, num_tokens: int, width: int, dtype: torch.dtype) -> "Tables":
        rows = num_tokens + 2 * EXTRA

        def empty(*shape, dt=torch.float32):
            return torch.empty(*shape, device=DEVICE, dtype=dt)

        return cls(
            dst=empty(num_tokens + EXTRA, dt=torch.int32),
            slot=empty(num_tokens + EXTRA, dt=torch.int32),
            vec=empty(SLOTS, width, dt=dtype), alpha=empty(SLOTS), factor=empty(SLOTS),
            cols=empty(SLOTS, NUM_COLS, dt=torch.int32), vals=empty(SLOTS, NUM_COLS),
            dirs=empty(SLOTS, width), out=empty(rows, width), out_sum=empty(rows, width, dt=dtype),
            out_half=empty(rows, width // 2, dt=dtype),
        )

    def refill(self, key) -> None:
        """New step: new contents in place (the addresses a graph recorded stay valid)."""
        seed("tables", key)
        num_tokens = self.dst.shape[0] - EXTRA
        width = self.vec.shape[1]
        self.dst.copy_(dst_table(num_tokens, self.out.shape[0]))
        self.slot.copy_(slot_table(num_tokens))
        self.vec.copy_(randn(SLOTS, width, self.vec.dtype))
        self.alpha.copy_(torch.randn(SLOTS))
        self.factor.copy_(torch.rand(SLOTS) + 0.5)
        self.cols.copy_(torch.stack([torch.randperm(width)[:NUM_COLS] for _ in range(SLOTS)]))
        self.vals.copy_(torch.randn(SLOTS, NUM_COLS))
        self.dirs.copy_(F.normalize(torch.randn(SLOTS, width), dim=1))
        for buf in (self.out, self.out_sum, self.out_half):
            buf.fill_(float("nan"))

    def clone(self) -> "Tables":
        return Tables(**{k: v.clone() for k, v in vars(self).items()})

    def to(self, device) -> "Tables":
        return Tables(**{k: v.to(device) for k, v in vars(self).items()})


def taps(h: torch.Tensor, r: torch.Tensor, t: Tables) -> None:
    """A layer's taps through the ops: edits of the residual stream, then three captures."""
    torch.ops.tapc.add_(h, r, t.slot, t.vec, t.alpha)
    torch.ops.tapc.scale_(h, r, t.slot, t.factor)
    torch.ops.tapc.set_cols_(h, r, t.slot, t.cols, t.vals)
    torch.ops.tapc.project_out_(h, r, t.slot, t.dirs)
    torch.ops.tapc.capture(h, t.dst, t.out)
    torch.ops.tapc.capture_sum(h, r, t.dst, t.out_sum)
    torch.ops.tapc.capture(h[:, : h.shape[1] // 2], t.dst, t.out_half)


def taps_ref(h: torch.Tensor, r: torch.Tensor, t: Tables) -> None:
    add_ref(h, r, t.slot, t.vec, t.alpha)
    scale_ref(h, r, t.slot, t.factor)
    set_cols_ref(h, r, t.slot, t.cols, t.vals)
    project_out_ref(h, r, t.slot, t.dirs)
    capture_ref(h, t.dst, t.out)
    capture_sum_ref(h, r, t.dst, t.out_sum)
    capture_ref(h[:, : h.shape[1] // 2], t.dst, t.out_half)


def expected_after(h: torch.Tensor, r: torch.Tensor, t: Tables) -> tuple[torch.Tensor, Tables]:
    h, t = h.clone(), t.clone()
    taps_ref(h, r, t)
    return h, t


def assert_same_step(h, want_h, t, want_t, dtype, what):
    assert_close(h, want_h, dtype, f"{what}: activation")
    assert_close(t.out, want_t.out, dtype, f"{what}: fp32 capture")
    assert_close(t.out_sum, want_t.out_sum, dtype, f"{what}: capture_sum")
    assert_close(t.out_half, want_t.out_half, dtype, f"{what}: column-slice capture")


def test_ops_declare_exactly_what_they_write():
    written = {
        name: {a.name for a in getattr(torch.ops.tapc, name).default._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
        for name in ("capture", "capture_sum", "add_", "scale_", "set_cols_", "project_out_",
                     "boundary")
    }
    assert written == {
        "capture": {"out"}, "capture_sum": {"out"}, "add_": {"x"}, "scale_": {"x"},
        "set_cols_": {"x"}, "project_out_": {"x"}, "boundary": {"x", "b"},
    }


def opcheck_cases():
    seed("opcheck")
    x, b = randn(5, 7, torch.float32), randn(5, 7, torch.float32)
    dst, slot = dst_table(5, 11), slot_table(5)
    on = dict(device=DEVICE)
    cols = torch.tensor([[0, -1], [3, 6], [1, 2]], dtype=torch.int32, **on)
    return {
        "capture": (x, dst, randn(11, 7, torch.float32)),
        "capture_sum": (x, b, dst, randn(11, 7, torch.float32)),
        "add_": (x.clone(), b, slot, randn(SLOTS, 7, torch.float32), torch.randn(SLOTS, **on)),
        "scale_": (x.clone(), None, slot, torch.randn(SLOTS, **on)),
        "set_cols_": (x.clone(), b, slot, cols, randn(SLOTS, 2, torch.float32)),
        "project_out_": (x.clone(), b, slot, F.normalize(randn(SLOTS, 7, torch.float32), dim=1)),
    }


@pytest.mark.parametrize("name", list(opcheck_cases()))
def test_op_passes_torch_opcheck(name):
    # Schema vs. actual mutation, fake implementation, AOT dispatch with dynamic shapes.
    args = opcheck_cases()[name]
    torch.library.opcheck(getattr(torch.ops.tapc, name).default, args)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_ops_dispatch_to_triton_or_the_reference(path, monkeypatch):
    device = DEVICE
    if path == "torch":  # CPU tensors with the interpreter off: the torch references
        monkeypatch.setattr(common, "INTERPRET", False)
        device = "cpu"
    ran = []
    for module, names in ((capture_kernels, ["capture", "capture_sum"]),
                          (edit_kernels, ["add_", "scale_", "set_cols_", "project_out_"])):
        for name in names:
            chosen = name if path == "triton" else name.rstrip("_") + "_ref"
            fn = getattr(module, chosen)
            monkeypatch.setattr(module, chosen, lambda *a, fn=fn: (ran.append(fn.__name__), fn(*a)))
    seed("paths")
    tables = Tables.new(7, 24, torch.float32).to(device)
    tables.refill("paths")
    h, r = randn(7, 24, torch.float32).to(device), randn(7, 24, torch.float32).to(device)
    want_h, want_t = expected_after(h, r, tables)
    taps(h, r, tables)
    assert_same_step(h, want_h, tables, want_t, torch.float32, f"{path} path")
    assert len(ran) == 7 and all(name.endswith("_ref") == (path == "torch") for name in ran), ran


def compiled_code(fn, *args) -> str:
    """The `call` function of the Inductor wrapper that fn compiles to."""
    _, sources = run_and_get_code(fn, *args)
    code = "\n".join(sources)
    return code[code.index("def call("):]


def assert_writes_in_place(code: str, tables: Tables) -> None:
    for buf in (tables.out, tables.out_sum, tables.out_half):
        shape = str(tuple(buf.shape))
        allocs = [line for line in code.splitlines() if "empty_strided" in line and shape in line]
        assert not allocs, f"capture buffer {shape} reallocated per step: {allocs}"
    assert "copy_(" not in code and "clone" not in code, code
    for name in ("add_", "scale_", "set_cols_", "project_out_", "capture_sum"):
        assert code.count(f"torch.ops.tapc.{name}.default(") == 1, code
    assert code.count("torch.ops.tapc.capture.default(") == 2, code


class TapModule(torch.nn.Module):
    """Taps inside a compiled module, on its input or (layer_like) on an intermediate.

    layer_like computes before and after the taps; on CPU that needs Inductor's C++ compiler,
    so the CPU test taps the input and the GPU test the intermediate.
    """

    def __init__(self, tables: Tables, layer_like: bool):
        super().__init__()
        self.tables = tables
        self.layer_like = layer_like

    def forward(self, h, r):
        if self.layer_like:
            h = h * 2.0
        taps(h, r, self.tables)
        return h + r if self.layer_like else h


def module_ref(h, r, tables, layer_like):
    want_h, want_t = expected_after(h * 2.0 if layer_like else h, r, tables)
    return want_h + r if layer_like else want_h, want_t


def test_compiled_module_runs_ops_in_place_and_follows_tables():
    torch._dynamo.reset()
    tables = Tables.new(7, 24, torch.float32)
    compiled = torch.compile(TapModule(tables, layer_like=False), fullgraph=True)
    r = randn(7, 24, torch.float32)
    for step in range(2):
        seed("compiled", step)
        h = randn(7, 24, torch.float32)
        tables.refill(("compiled", step))
        want, want_t = module_ref(h, r, tables, layer_like=False)
        if step == 0:
            assert_writes_in_place(compiled_code(compiled, h.clone(), r), tables)
            tables.refill(("compiled", step))  # the traced call above ran the taps once
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = compiled(h, r)
        assert_same_step(got, want, tables, want_t, torch.float32, f"compiled, step {step}")


@pytest.fixture
def handler():
    calls = []

    def record(point, x, b):
        calls.append((point, x.shape, None if b is None else b.shape))
        x.mul_(point)
        if b is not None:
            b.add_(1.0)

    ops.set_boundary_handler(record)
    yield calls
    ops.set_boundary_handler(None)


def test_boundary_without_handler_says_how_to_set_one():
    words = r"tap point 4 but no boundary handler.*set_boundary_handler\(fn\)"
    with pytest.raises(RuntimeError, match=words):
        torch.ops.tapc.boundary(randn(3, 5, torch.float32), None, 4)


def test_boundary_calls_the_handler_in_place(handler):
    x, b = randn(3, 5, torch.float32), randn(3, 5, torch.float32)
    x0, b0 = x.clone(), b.clone()
    torch.ops.tapc.boundary(x, b, 3)
    torch.ops.tapc.boundary(x, None, 2)
    assert handler == [(3, x.shape, b.shape), (2, x.shape, None)]
    assert torch.equal(x, x0 * 6) and torch.equal(b, b0 + 1)


def test_boundary_is_opaque_to_the_compiler(handler):
    torch._dynamo.reset()

    def layer(h, r):
        h = h + 1.0
        torch.ops.tapc.boundary(h, r, 5)
        return h * r

    h, r = randn(3, 5, torch.float32), randn(3, 5, torch.float32)
    want = (h + 1.0) * 5 * (r + 1.0)
    # aot_eager: functionalized like Inductor's input, with no C++ compiler needed on CPU.
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(h, r.clone())
    assert handler == [(5, h.shape, r.shape)]
    torch.testing.assert_close(got, want)


GRAPH_CASE = (123, 2560, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_cuda_graph_replays_follow_the_tables():
    num_tokens, width, dtype = GRAPH_CASE
    seed("graph")
    tables = Tables.new(num_tokens, width, dtype)
    tables.refill("graph warmup")
    h, r = randn(num_tokens, width, dtype), randn(num_tokens, width, dtype)
    taps(h.clone(), r, tables)  # compiles the Triton kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        taps(h, r, tables)
    for step in range(4):
        seed("graph", step)
        h.copy_(randn(num_tokens, width, dtype))
        tables.refill(("graph", step))
        want_h, want_t = expected_after(h, r, tables)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_step(h, want_h, tables, want_t, dtype, f"replay {step}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_compiled_module_replays_from_a_cuda_graph():
    torch._dynamo.reset()
    num_tokens, width, dtype = GRAPH_CASE
    seed("compiled graph")
    tables = Tables.new(num_tokens, width, dtype)
    tables.refill("compiled graph warmup")
    compiled = torch.compile(TapModule(tables, layer_like=True), fullgraph=True)
    h, r = randn(num_tokens, width, dtype), randn(num_tokens, width, dtype)
    assert_writes_in_place(compiled_code(compiled, h, r), tables)
    compiled(h, r)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = compiled(h, r)
    for step in range(4):
        seed("compiled graph", step)
        h.copy_(randn(num_tokens, width, dtype))
        tables.refill(("compiled graph", step))
        want, want_t = module_ref(h, r, tables, layer_like=True)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_step(result, want, tables, want_t, dtype, f"compiled replay {step}")
