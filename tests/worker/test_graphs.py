"""FULL graphs broken at blocks: the boundary handler's two ways, the class swap during capture,
and (GPU) a captured graph whose replay runs graph, block, graph on fresh inputs."""
import pytest
import torch

from tapc.worker import graphs
from tapc.worker.graphs import SegmentedGraph, breaking
from tapc.worker.patches import capture_patch


@pytest.fixture
def no_weak_refs(monkeypatch):
    import vllm.utils.torch_utils as tu

    monkeypatch.setattr(tu, "weak_ref_tensor", lambda t: t.view(t.shape))  # a new alias, like vLLM's


def test_boundary_runs_the_block_at_once_outside_a_capture(no_weak_refs):
    calls = []
    handler = breaking(lambda point, x, b: calls.append((point, x, b)))
    x = torch.randn(3, 4)
    handler(2, x, None)
    assert calls == [(2, x, None)]


def test_boundary_during_a_capture_becomes_a_break(no_weak_refs, monkeypatch):
    calls, breaks = [], []

    class Capturing:
        def break_here(self, block):
            breaks.append(block)
            block()   # as SegmentedGraph does: run now (capture time), keep for replay

    monkeypatch.setattr(SegmentedGraph, "capturing", Capturing())
    handler = breaking(lambda point, x, b: calls.append((point, x.data_ptr(), b.data_ptr())))
    x, b = torch.randn(3, 4), torch.randn(3, 4)
    handler(5, x, b)
    assert len(breaks) == 1 and calls == [(5, x.data_ptr(), b.data_ptr())]
    breaks[0]()   # replay: the same point, the same addresses
    assert calls[1] == calls[0]


def test_runner_captures_segmented_graphs_and_the_class_comes_back():
    seen = []

    class Runner:
        def capture_model(self):
            seen.append(torch.cuda.CUDAGraph)
            raise RuntimeError("capture failed")

    runner = Runner()
    capture_patch(runner, SegmentedGraph).apply()
    with pytest.raises(RuntimeError, match="capture failed"):
        runner.capture_model()
    assert seen == [SegmentedGraph]
    assert torch.cuda.CUDAGraph is graphs._CUDAGraph, "put back even when the capture raises"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_segmented_graph_replays_graph_block_graph_on_new_inputs(no_weak_refs):
    """x -> h = x @ w (segment 1) -> block edits h in place, reading a host-side value that
    changes between replays -> y = relu(h) @ w (segment 2). Replays equal eager runs."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, device="cuda") / 8
    x = torch.randn(16, 64, device="cuda")
    shift = {"v": 0.0}
    handler = breaking(lambda point, h, b: h.add_(shift["v"] * (point + 1)))

    def forward():
        h = x @ w
        torch.ops.tapc.boundary(h, None, 0)
        return torch.relu(h) @ w

    import tapc.kernels  # noqa: F401  registers torch.ops.tapc.boundary
    from tapc.kernels.ops import set_boundary_handler

    set_boundary_handler(handler)
    try:
        forward()  # warm up outside the capture
        torch.cuda.synchronize()
        graph = SegmentedGraph()
        with torch.cuda.graph(graph):
            y = forward()
        assert len(graph.steps) == 1
        for v in (0.0, 0.5, -2.0):
            x.copy_(torch.randn(16, 64, device="cuda"))
            shift["v"] = v
            graph.replay()
            torch.cuda.synchronize()
            expected = torch.relu(x @ w + v) @ w
            torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    finally:
        set_boundary_handler(None)
