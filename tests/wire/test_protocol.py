"""The wire between the API and the worker: typed values that survive msgpack, and messages
of another version or shape refused with words that say so."""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, Req, ToyModel, collect, hooks_for, over_the_wire, run, toy_plan, wire_for

from tapc.wire.protocol import VERSION, Ask, BlockFailure, Chunk, CollectReply, Result, StoreResult, TensorData, \
    WireRequest, encode_value
from tapc.api.requests import TapRequest, check
from tapc.errors import ProtocolError, RequestError
from tapc.api.session import TapSession

TAPS = ["model.layers.*.resid", "model.layers.1.resid | add(steer, alpha=a)", "model.layers.0.resid | zero(cols)",
        "logits", "samples"]


def test_a_request_survives_msgpack_as_itself():
    plan = toy_plan(TAPS)
    rng = np.random.default_rng(0)
    for ask in [TapRequest(capture="*", positions=[3, 1, 7], params={"steer": rng.standard_normal(HIDDEN), "a": 2.0}),
                TapRequest(capture=["logits", "model.layers.2.resid"], positions="generated", params={"cols": [4, 2]}),
                TapRequest()]:
        wire = WireRequest("id-1", check(plan, ask, "r"))
        assert WireRequest.from_wire(over_the_wire(wire.to_wire())) == wire


def test_a_result_survives_msgpack_as_itself():
    g = torch.Generator().manual_seed(1)
    engine = {"logits": TensorData.of(torch.randn(3, 5, generator=g)),
              "samples": TensorData.of(torch.randint(0, 9, (3, 1), dtype=torch.int32, generator=g))}
    failure = BlockFailure.capture("probe", "model.layers.1.resid", ValueError("bad", 3))
    result = Result("t", stores=(StoreResult(("k1", "k2"), "bfloat16", 16, 7, (Chunk("/dev/shm/f", 512, 8, 7),)),
                                 StoreResult(("k3",), "float32", 4, 2, (Chunk("", 0, 2, 2, bytes(range(32))),), rank=1)),
                    engine=engine, saved={"n": (encode_value((1, [2.5, None])),)}, block_error=failure)
    back = CollectReply.from_wire(over_the_wire(CollectReply((result, Result("u", error="why"))).to_wire())).by_id()
    assert back["t"] == result and back["u"].error == "why"
    assert back["t"].saved_values() == {"n": [(1, [2.5, None])]}
    exc = back["t"].block_error.exception_for_caller()
    assert type(exc) is ValueError and exc.args == ("bad", 3)


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (5, 3)), (torch.bfloat16, (2, 7)), (torch.int64, (4,)),
                                         (torch.bool, (3, 2)), (torch.float16, ()), (torch.float32, (0, 9))])
def test_tensors_travel_as_bytes_dtype_and_shape(dtype, shape):
    t = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 10).to(dtype)
    back = TensorData.from_wire(over_the_wire(TensorData.of(t).to_wire())).tensor()
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    strided = torch.arange(24, dtype=torch.float32).view(4, 6)[:, ::2]   # a view: packed on the way
    assert torch.equal(TensorData.of(strided).tensor(), strided)


@pytest.mark.parametrize("edit,words", [
    (lambda d: d.update(version=VERSION + 1), f"protocol version {VERSION + 1}, but this side speaks version {VERSION}"),
    (lambda d: d.pop("version"), "protocol version None"),
    (lambda d: d.pop("positions"), "no field 'positions'"),
    (lambda d: d.update(capture="model.layers.0.resid"), "field 'capture' is a str"),
    (lambda d: d.update(blocks="code"), "field 'blocks' is a str"),
    (lambda d: d.update(params={"steer": "0.5"}), "parameter 'steer' is a str, not bytes"),
    (lambda d: d.update(positions=[1, "2"]), "'positions' holds something other than numbers"),
])
def test_a_malformed_request_is_refused_with_the_field(edit, words):
    d = WireRequest("id", check(toy_plan(TAPS), TapRequest(capture="*"), "r")).to_wire()
    edit(d)
    with pytest.raises(ProtocolError, match=words.replace("(", r"\(")):
        WireRequest.from_wire(d)


def test_a_reply_of_another_version_is_refused():
    reply = CollectReply((Result("t"),)).to_wire()
    reply["version"] = VERSION + 1
    with pytest.raises(ProtocolError, match="collect reply of protocol version"):
        TapSession(toy_plan(TAPS)).results(reply)


@pytest.mark.parametrize("chunk,words", [([1, 2, 3], "a capture chunk is"), (["", 0, 2, 2, "rows"], "bytes, not str")])
def test_a_malformed_chunk_is_refused_with_what_a_chunk_is(chunk, words):
    reply = CollectReply((Result("t", stores=(StoreResult(("k",), "float32", 4, 2, ()),)),)).to_wire()
    reply["results"][0]["stores"][0]["chunks"] = [chunk]
    with pytest.raises(ProtocolError, match=words):
        CollectReply.from_wire(reply)


def test_the_worker_runs_a_request_of_another_version_untapped_and_says_why():
    """Through the toy runner: the bad request comes back with its error, the one beside it whole."""
    plan = toy_plan(["model.layers.*.resid"])
    runner, hooks = hooks_for(plan, ToyModel())
    rng = np.random.default_rng(3)
    good = Req("good", rng.integers(0, 50, 6).tolist(), 3, wire_for(plan, TapRequest(capture="*"), "t-good"))
    bad = Req("bad", rng.integers(0, 50, 5).tolist(), 3, wire_for(plan, TapRequest(capture="*"), "t-bad"))

    class OtherVersion(WireRequest):
        def to_wire(self):
            return {**super().to_wire(), "version": VERSION + 1}

    bad.wire = OtherVersion(bad.wire.id, bad.wire.ask)
    run(runner, [good, bad], budget=64)
    outs = collect(hooks, [good, bad], TapSession(plan))
    assert isinstance(outs["bad"].error, RequestError) and "protocol version" in str(outs["bad"].error)
    assert outs["good"].error is None and outs["good"].taps["model.layers.2.resid"].shape[0] == 6 + 3 - 1
    assert not hooks.records and not hooks.by_id and not hooks.errors


def test_an_ask_that_asks_nothing_is_empty():
    plan = toy_plan(TAPS)
    assert check(plan, TapRequest(), "r").empty and Ask().empty
    assert not check(plan, TapRequest(capture="logits"), "r").empty
    assert not check(plan, TapRequest(params={"cols": 1}), "r").empty
