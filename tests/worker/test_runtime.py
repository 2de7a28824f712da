"""Boundary blocks on CPU: per-request views, in-place edits, saved values, failures isolated."""
import torch

from tapc.wire.protocol import decode_value
from tapc.errors import BlockFailed
from tapc.worker.runtime import BlockPoint, BlockRuntime, Span


def slab(rows=10, width=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g)


def runtime(*points):
    return BlockRuntime([BlockPoint(key, name) for key, name in points])


def test_each_request_sees_only_its_rows_with_its_context():
    rt = runtime(("model.layers.1.mlp.output", "probe"))
    seen = []
    rt.register({"probe": lambda ctx, x: seen.append((ctx.request_id, ctx.step, ctx.positions, ctx.is_prompt, x.clone()))})
    rt.admit("a", prompt_len=3)
    rt.admit("b", prompt_len=5)
    x = slab()
    # prefill of a (rows 0..2) and b (rows 3..7); rows 8, 9 are padding
    rt.begin_step([Span("a", 0, 3, 0), Span("b", 3, 8, 0)])
    rt(0, x, None)
    # decode: one row each, b first this time
    rt.begin_step([Span("b", 0, 1, 5), Span("a", 1, 2, 3)])
    rt(0, x, None)
    assert [(r, s, p, pr) for r, s, p, pr, _ in seen] == [
        ("a", 0, range(0, 3), True), ("b", 0, range(0, 5), True), ("b", 1, range(5, 6), False), ("a", 1, range(3, 4), False)]
    assert torch.equal(seen[0][4], x[0:3]) and torch.equal(seen[1][4], x[3:8])
    assert torch.equal(seen[2][4], x[0:1]) and torch.equal(seen[3][4], x[1:2])


def test_in_place_edit_and_returned_tensor_reach_only_own_rows():
    rt = runtime(("p", "double"), ("p2", "replace"))
    rt.register({"double": lambda ctx, x: x.mul_(2), "replace": lambda ctx, x: torch.full_like(x, 7.0)})
    rt.admit("a", 2)
    x = slab()
    before = x.clone()
    rt.begin_step([Span("a", 2, 4, 0)])
    rt(0, x, None)
    expected = before.clone()
    expected[2:4] *= 2
    assert torch.equal(x, expected)
    rt(1, x, None)
    expected[2:4] = 7.0
    assert torch.equal(x, expected)


def test_resid_point_sees_the_sum_and_writes_hidden_so_the_sum_is_edited():
    rt = runtime(("model.layers.0.resid", "halve"))
    rt.register({"halve": lambda ctx, s: s.mul_(0.5)})
    rt.admit("a", 4)
    h, r = slab(seed=1), slab(seed=2)
    total = h + r
    r_before = r.clone()
    rt.begin_step([Span("a", 1, 5, 0)])
    rt(0, h, r)
    assert torch.equal(r, r_before)
    expected = total.clone()
    expected[1:5] *= 0.5
    torch.testing.assert_close(h + r, expected)


def test_resid_rows_of_requests_without_blocks_are_left_bit_for_bit():
    """The sum is made and written back per run of adjacent block rows: an untapped request
    between two tapped ones, and the padding after them, keep their exact hidden values."""
    rt = runtime(("model.layers.0.resid", "scale"))
    rt.register({"scale": lambda ctx, s: s.mul_(2.0 if ctx.request_id == "a" else -1.0)})
    rt.admit("a", 4)
    rt.admit("c", 4)
    h, r = slab(12, seed=3).bfloat16(), slab(12, seed=4).bfloat16()
    h_before, total = h.clone(), (h + r).float()
    rt.begin_step([Span("a", 0, 3, 0), Span("untapped", 3, 5, 0), Span("c", 5, 9, 0)])
    rt(0, h, r)
    assert torch.equal(h[3:5], h_before[3:5]) and torch.equal(h[9:], h_before[9:])
    torch.testing.assert_close((h + r).float()[:3], 2.0 * total[:3], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close((h + r).float()[5:9], -total[5:9], rtol=2e-2, atol=2e-2)


def test_saved_values_come_back_per_request():
    rt = runtime(("p", "probe"))
    rt.register({"probe": lambda ctx, x: ctx.save("mean", x.mean(dim=-1))})
    rt.admit("a", 2)
    rt.admit("b", 2)
    x = slab()
    rt.begin_step([Span("a", 0, 2, 0), Span("b", 2, 4, 0)])
    rt(0, x, None)
    rt.begin_step([Span("a", 0, 1, 2)])
    rt(0, x, None)
    saved, err = rt.take("a")
    assert err is None and len(saved["mean"]) == 2
    torch.testing.assert_close(decode_value(saved["mean"][0]), x[0:2].mean(dim=-1))
    torch.testing.assert_close(decode_value(saved["mean"][1]), x[0:1].mean(dim=-1))
    assert rt.take("a") == ({}, None)
    saved_b, _ = rt.take("b")
    torch.testing.assert_close(decode_value(saved_b["mean"][0]), x[2:4].mean(dim=-1))


class Custom(Exception):
    pass


def test_a_failing_block_fails_its_request_only():
    rt = runtime(("p", "probe"))

    def probe(ctx, x):
        if ctx.request_id == "bad" and ctx.step == 1:
            raise Custom("boom at step 1")
        x.add_(1)

    rt.register({"probe": probe})
    for rid in ("a", "bad", "c", "d"):
        rt.admit(rid, 1)
    x = torch.zeros(4, 3)
    spans = [Span(rid, i, i + 1, 0) for i, rid in enumerate(("a", "bad", "c", "d"))]
    for _ in range(3):
        rt.begin_step(spans)
        rt(0, x, None)
    # bad ran once (step 0), failed at step 1, and never ran again; the others ran 3 times
    assert x[:, 0].tolist() == [3, 1, 3, 3]
    _, err = rt.take("bad")
    assert err is not None and err.type_name.endswith("Custom") and "boom at step 1" in err.message
    exc = err.exception_for_caller()
    assert isinstance(exc, Custom) and "in tapc block `probe` at p" in exc.__notes__[0]
    assert "raise Custom" in exc.__notes__[0]
    for rid in ("a", "c", "d"):
        assert rt.take(rid)[1] is None


def test_wrong_shape_and_missing_block_fail_the_request():
    rt = runtime(("p", "shape"), ("q", "missing"))
    rt.register({"shape": lambda ctx, x: x[:, :1]})
    rt.admit("a", 1)
    rt.admit("b", 1)
    x = slab()
    rt.begin_step([Span("a", 0, 2, 0)])
    rt(0, x, None)
    _, err = rt.take("a")
    assert "returned (2, 1)" in err.message and "x's shape (2, 6)" in err.message
    rt.begin_step([Span("b", 0, 2, 0)])
    rt(1, x, None)
    _, err = rt.take("b")
    assert "no block named 'missing'" in err.message


def test_unpicklable_exception_keeps_its_words():
    import threading

    class Holding(Exception):  # carries a lock: it cannot cross a process boundary
        def __init__(self, msg):
            super().__init__(msg)
            self.lock = threading.Lock()

    rt = runtime(("p", "probe"))
    rt.register({"probe": lambda ctx, x: (_ for _ in ()).throw(Holding("local failure"))})
    rt.admit("a", 1)
    rt.begin_step([Span("a", 0, 1, 0)])
    rt(0, slab(), None)
    _, err = rt.take("a")
    exc = err.exception_for_caller()
    assert isinstance(exc, BlockFailed) and "Holding: local failure" in str(exc)


def test_exception_type_comes_back_when_the_caller_has_it_loaded():
    """By module and name, no unpickling: a module-level class (or a builtin one, with its
    arguments) is itself again; a class defined in a function has no name to find it by."""
    class Local(Exception):
        pass

    rt = runtime(("p", "probe"))
    errors = {"a": Custom("module level"), "b": KeyError("missing key"), "c": Local("local failure")}
    rt.register({"probe": lambda ctx, x: (_ for _ in ()).throw(errors[ctx.request_id])})
    for rid in errors:
        rt.admit(rid, 1)
    rt.begin_step([Span(rid, i, i + 1, 0) for i, rid in enumerate(errors)])
    rt(0, slab(), None)
    a, b, c = (rt.take(rid)[1].exception_for_caller() for rid in errors)
    assert type(a) is Custom and str(a) == "module level"
    assert type(b) is KeyError and b.args == ("missing key",)
    assert type(c) is BlockFailed and "Local: local failure" in str(c)
    assert all("in tapc block `probe` at p" in e.__notes__[0] for e in (a, b, c))


def test_a_value_that_cannot_be_saved_fails_the_request_with_its_name():
    rt = runtime(("p", "probe"))
    values = {"a": {"ok": [1, 2.5, "s", None, b"x", (True, torch.ones(2, dtype=torch.bfloat16))]},
              "b": {"bad": [1, {2: 3}]}, "c": {"bad": range(3)}}
    rt.register({"probe": lambda ctx, x: [ctx.save(k, v) for k, v in values[ctx.request_id].items()] and None})
    for rid in values:
        rt.admit(rid, 1)
    rt.begin_step([Span(rid, i, i + 1, 0) for i, rid in enumerate(values)])
    rt(0, slab(), None)
    saved, err = rt.take("a")
    back = decode_value(saved["ok"][0])
    assert err is None and back[:5] == [1, 2.5, "s", None, b"x"] and back[5][0] is True
    assert torch.equal(back[5][1], torch.ones(2, dtype=torch.bfloat16)) and isinstance(back[5], tuple)
    assert "ctx.save('bad', ...)[1]: dict key 2 is not a str" in rt.take("b")[1].message
    assert "ctx.save('bad', ...) is a builtins.range; a saved value is a tensor" in rt.take("c")[1].message


def test_per_request_block_overrides_the_engine_one():
    rt = runtime(("p", "probe"))
    rt.register({"probe": lambda ctx, x: x.fill_(1)})
    rt.admit("a", 1)
    rt.admit("b", 1, blocks={"probe": lambda ctx, x: x.fill_(2)})
    x = slab()
    rt.begin_step([Span("a", 0, 1, 0), Span("b", 1, 2, 0)])
    rt(0, x, None)
    assert x[0].eq(1).all() and x[1].eq(2).all()


def test_requests_without_blocks_are_skipped():
    rt = runtime(("p", "probe"))
    calls = []
    rt.register({"probe": lambda ctx, x: calls.append(ctx.request_id)})
    rt.admit("a", 1)
    rt.begin_step([Span("a", 0, 1, 0), Span("untapped", 1, 2, 0)])
    rt(0, slab(), None)
    assert calls == ["a"]
