"""A captured CUDA graph's tap kernels switched off and on between replays (tapc/worker/switch.py),
with tapc's real kernels and the CUDA driver, against the same computation in plain torch."""
import pytest
import torch

from tapc.worker.patches import Patch
from tapc.worker.cugraph import Driver
from tapc.worker.switch import ALL, Switch, SwitchedGraph
from tapc.kernels import ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, WIDTH, SLOTS = 16, 256, 4


def test_a_graphs_tap_nodes_switch_off_and_on_and_nothing_else_does():
    driver = Driver.load()
    assert driver is not None, "the driver has the calls (CUDA 12.3 or newer)"
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    table = torch.full((3, ROWS), -1, dtype=torch.int32, device=dev)   # taps 0, 1: captures; 2: an edit
    switch = Switch(driver, table, ops.KERNELS)
    x = torch.randn(ROWS, WIDTH, device=dev, generator=g)
    w = torch.randn(WIDTH, WIDTH, device=dev, generator=g) * 0.05
    vec = torch.randn(SLOTS, WIDTH, device=dev, generator=g)
    alpha = torch.tensor([0.5, -1.0, 2.0, 3.0], device=dev)
    pools = [torch.zeros(ROWS, WIDTH, device=dev) for _ in range(2)]
    out = torch.zeros(ROWS, WIDTH, device=dev)

    def forward():
        h = x @ w                                                   # the model's kernels ...
        torch.ops.tapc.capture(h, table[0], pools[0])
        h2 = h * 2
        torch.ops.tapc.add_(h2, None, table[2], vec, alpha)
        torch.ops.tapc.capture_sum(h2, h, table[1], pools[1])
        torch.ops.tapc.capture(h2[:0], table[0], pools[0])         # no rows: launches nothing
        out.copy_(torch.tanh(h2))                                   # ... after it, not a tap's

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.synchronize()
    graph = SwitchedGraph.bound(switch)()
    with Patch(ops, "_launch_observer", switch.observe), torch.cuda.graph(graph):
        forward()
    assert sorted(graph.nodes.values()) == [1, 2, 4], "capture, add_, capture_sum: one node each, by their taps"
    assert graph.bare is not None, "a copy without them, for steps that ask for no tap"

    table[0] = torch.arange(ROWS, device=dev, dtype=torch.int32).flip(0)
    table[1] = torch.arange(ROWS, device=dev, dtype=torch.int32)
    table[2] = torch.arange(ROWS, device=dev, dtype=torch.int32) % SLOTS
    h = x @ w
    steered = h * 2 + alpha[table[2].long(), None] * vec[table[2].long()]

    def replay(want: int):
        for p in pools:
            p.zero_()
        out.zero_()
        switch.want = want
        graph.replay()
        torch.cuda.synchronize()

    def close(a, b, what):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=lambda m: f"{what}: {m}")

    for _ in range(2):   # on, off, partly on, on again: each state from the one before
        replay(ALL)
        close(pools[0], h.flip(0), "capture, on")
        close(pools[1], steered + h, "edit then capture_sum, on")
        close(out, torch.tanh(steered), "the model's output, steered")

        for want, how in ((0, "the bare copy"), (1 << 5, "every tap node disabled")):
            replay(want)
            assert not pools[0].any() and not pools[1].any(), f"{how}: no tap kernel runs, though the tables ask"
            close(out, torch.tanh(h * 2), f"{how}: the model's kernels still run, unsteered")
        exec_ = graph.raw_cuda_graph_exec()
        assert not any(driver.enabled(exec_, node) for node in graph.nodes)

        replay(1 << 1)   # only the capture_sum's tap
        assert not pools[0].any()
        close(pools[1], h * 2 + h, "capture_sum alone")
        close(out, torch.tanh(h * 2), "the edit stays off")


def test_ops_outside_graphs_skip_unasked_taps_but_never_while_a_graph_is_captured():
    """Batches larger than vLLM's graphs call the ops eagerly: a tap the step does not ask for
    launches nothing there (`Switch.idle`), yet an op under a graph capture always launches, or
    the graph would lack its node for good."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    table = torch.full((2, ROWS), -1, dtype=torch.int32, device=dev)
    table[0] = torch.arange(ROWS, device=dev, dtype=torch.int32)
    switch = Switch(None, table, ops.KERNELS)
    x = torch.randn(ROWS, WIDTH, device=dev, generator=g)
    pool = torch.zeros(ROWS, WIDTH, device=dev)
    with Patch(ops, "_idle", switch.idle):
        torch.ops.tapc.capture(x, table[0], pool)   # warm up: a dummy run launches every op
        torch.cuda.synchronize()
        assert torch.equal(pool, x), "not in a step yet: it launches"
        pool.zero_()
        switch.stepping, switch.want = True, 1 << 1
        torch.ops.tapc.capture(x, table[0], pool)
        torch.cuda.synchronize()
        assert not pool.any(), "the step asks nothing of tap 0: no launch, though its table has rows"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.ops.tapc.capture(x, table[0], pool)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(pool, x), "under capture it launched: the graph has the node"
        pool.zero_()
        switch.want = 1 << 0
        torch.ops.tapc.capture(x, table[0], pool)
        torch.cuda.synchronize()
        assert torch.equal(pool, x), "asked for: it launches"
