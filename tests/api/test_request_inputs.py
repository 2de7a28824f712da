"""Every request answered (issue 63): a wrong value of any `TapRequest` field, or of any field
of an HTTP ask (`vllm_xargs.tapc`), is a one-line `TapcError` from the session's check or
prepare, or an HTTP 400 from `tapc serve`; never another exception, never a 500, never a
silent yes. The fields walked are read from the code, so a new field without wrong values
here fails."""
import dataclasses
import json
import re
import time

import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, LAYERS, Req, ToyModel, collect, hooks_for, run, toy_plan, toy_vllm
from toy_functions import clamp
from toy_server import client, stand_in_app
from vllm import SamplingParams

from tapc.api.requests import TapRequest
from tapc.api.session import TapSession
from tapc.errors import RequestError, TapcError
from tapc.lang.edits import EDITS
from tapc.serving.asks import FIELDS

TAPS = ["model.layers.*.resid", "model.layers.1.resid | add(steer, alpha=alpha)",
        "model.layers.2.resid | set(cols, vals)", "model.layers.0.resid | patch(src, rows=4)"]
# every kind of parameter, a compiled function's results and a block
PLAN_TAPS = TAPS + ["model.layers.2.mlp.down_proj.output | call(clamp)", "model.layers.0.mlp.down_proj.output -> probe"]

GOOD = {"steer": [0.5] * HIDDEN, "alpha": 2.0, "cols": [1], "vals": [3.0], "thr": 1.0,
        "src": {"positions": [1], "rows": [[0.25] * HIDDEN]}}

# wrong values of each parameter kind that JSON can carry (both ways in take them)
WRONG_VALUES = {
    "vector": [None, [], [1.0] * 3, [[1.0] * HIDDEN], [1e300] * HIDDEN, [1e39] * HIDDEN, [float("nan")] * HIDDEN,
               [True] * HIDDEN, [0.5] * (HIDDEN - 1) + [None], ["1"] * HIDDEN, {"a": 1}, 5],
    "scalar": [None, 1e39, -1e39, 10**400, float("inf"), float("nan"), True, [1.0], {"a": 1}],
    "columns": [None, [], [-1], [HIDDEN], [1, 1], [1.5], [True], list(range(65)), {"a": 1}, 2**70],
    "values": [None, [], 1e300, [1e39], ["a"], [None], True, [True], {"a": 1}, float("nan")],
    "rows": [None, 5, [], {"positions": [1]}, {"positions": [2**31], "rows": [[0.0] * HIDDEN]},
             {"positions": [2**64], "rows": [[0.0] * HIDDEN]}, {"positions": [], "rows": []},
             {"positions": [1], "rows": [[1e39] * HIDDEN]}, {"positions": [1], "rows": [[True] * HIDDEN]},
             {"positions": [1, 1], "rows": [[0.0] * HIDDEN] * 2}, {"positions": [-1], "rows": [[0.0] * HIDDEN]},
             {"positions": [True], "rows": [[0.0] * HIDDEN]}, {"positions": "1", "rows": [[0.0] * HIDDEN]},
             {"positions": [1], "rows": [[0.0] * HIDDEN], "more": 1}],
}
# ... and what only Python can pass
WRONG_PY_VALUES = {
    "vector": [torch.ones(HIDDEN, dtype=torch.bool), np.ones(HIDDEN, dtype=bool), np.full(HIDDEN, 1e300),
               torch.full((HIDDEN,), float("inf")), b"\x00" * 4 * HIDDEN, np.array(["a"] * HIDDEN)],
    "scalar": [np.float64(1e39), np.bool_(True), b"1", "2.0", 2 + 0j],
    "columns": [np.array([1.0]), b"\x01", "1"],
    "values": [np.float64(1e300), b"\x01", "1"],
    "rows": [{"positions": range(10**9), "rows": [[0.0] * HIDDEN]},
             {"positions": [1], "rows": torch.ones(1, HIDDEN, dtype=torch.bool)}],
}


def block(ctx, x):
    return x


def wrong_fields(json_only: bool = False) -> dict:
    """TapRequest field -> wrong values (a params value is the whole field: GOOD with one wrong)."""
    params = [None, [("alpha", 1)], 5, "steer", {"nope": 1.0}, {1: 1.0}]
    kinds = {p.name: p.kind for p in toy_plan(PLAN_TAPS, functions={"clamp": clamp}).params}
    for name, kind in kinds.items():
        values = WRONG_VALUES[kind] + ([] if json_only else WRONG_PY_VALUES[kind])
        params += [{**GOOD, name: v} for v in values]
    return {
        "capture": [None, 123, [1], ["model.layers.0.resid", None], b"logits", [b"logits"], {"*": 1}, "nope",
                    "model.layers.9.resid", ["*", "model.layers.2.mlp.down_proj.output:clamp.scorez"]],
        "positions": [None, 5, [], [-1], [1.5], [True], [1, 1], "middle", [2**31], [10**30], [[1]], {1: 2},
                      b"\x01", range(10**9), [1, 10**6]],
        "params": params,
        "blocks": [None, [block], {"nope": block}, {"probe": 5}],
    }


def test_the_walk_covers_every_field_and_every_parameter_kind():
    """A field of TapRequest, an HTTP ask field, or a parameter kind without wrong values here
    fails: add its wrong values."""
    assert {f.name for f in dataclasses.fields(TapRequest)} == set(wrong_fields())
    assert set(FIELDS) == set(WRONG_ASKS)
    edit_kinds = {kind for op in EDITS.values() for _, kind, _ in op.args} - {"count"}   # `count`: literals only
    assert edit_kinds | {"scalar", "vector"} == set(WRONG_VALUES) == set(WRONG_PY_VALUES)   # + call()'s kinds
    assert {p.kind for p in toy_plan(PLAN_TAPS, functions={"clamp": clamp}).params} == set(WRONG_VALUES)


def walked(fields: dict) -> list:
    return [(name, value) for name, values in fields.items() for value in values]


@pytest.fixture(scope="module")
def session():
    plan = toy_plan(PLAN_TAPS, functions={"clamp": clamp})
    return TapSession(plan, max_model_len=64)


def value_id(v) -> str:
    """A test id that is the same in every process (pytest-xdist compares them): no addresses."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(v))[:40]


@pytest.mark.parametrize("field,value", walked(wrong_fields()), ids=value_id)
def test_every_wrong_value_of_every_field_is_a_one_line_tapc_error(session, field, value):
    good = TapRequest(capture="*", positions="all", params=GOOD, blocks={"probe": block})
    ask = dataclasses.replace(good, **{field: value})
    t0 = time.perf_counter()
    with pytest.raises(TapcError) as e:
        session.prepare(SamplingParams(max_tokens=4), session.check(ask, "request 7"), "request 7", [1, 2, 3])
    message = str(e.value)
    assert time.perf_counter() - t0 < 2, "bounded before anything is made of it"
    assert message.startswith("request 7: ") and "\n" not in message and len(message) < 600, message
    assert field.rstrip("s") in message, message


def test_a_request_that_is_no_taprequest_is_a_tapc_error(session):
    with pytest.raises(RequestError, match=r"^request 0: taps must be a tapc.TapRequest, got \{'capture': '\*'\}$"):
        session.check({"capture": "*"}, "request 0")


# ----------------------------------------------------------------------------- over HTTP

HTTP_GOOD = {k: v for k, v in GOOD.items() if k != "thr"}   # the served plan has no function
WRONG_ASKS = {   # vllm_xargs.tapc field -> wrong values; "params" from the kinds' JSON values
    "capture": [None, 123, [1], ["model.layers.0.resid", None], {"*": 1}, "nope", True],
    "positions": [None, 5, [], [-1], [1.5], [True], [1, 1], "middle", [2**31], [10**30], [[1]], {"1": 2}, [1, 10**6]],
    "params": [None, [["alpha", 1]], 5, "steer", {"nope": 1.0}, {"steer": "unregistered"}]
              + [{**HTTP_GOOD, p.name: v} for p in toy_plan(TAPS).params for v in WRONG_VALUES[p.kind]],
    "inline": [None, "yes", 1],
    "save": [None, "yes", 1, True],   # true: this server has no save folder
}
WRONG_BODIES = [{"vllm_xargs": [1]}, {"vllm_xargs": "tapc"}, {"vllm_xargs": {"tapc": 5}},
                {"vllm_xargs": {"tapc": "[1]"}}, {"vllm_xargs": {"tapc": json.dumps({"inline": True, "save": True})}},
                {"stream": True, "stream_options": [1], "vllm_xargs": {"tapc": json.dumps({"capture": "*"})}}]


def test_every_wrong_ask_over_http_is_a_400_naming_the_field():
    app, hooks = stand_in_app(TAPS)
    base = {"capture": "*", "positions": "all", "params": HTTP_GOOD}
    with client(app) as c:
        ok = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2,
                                             "vllm_xargs": {"tapc": json.dumps(base)}})
        assert ok.status_code == 200, ok.text
        wrong = []
        for field, value in walked(WRONG_ASKS):
            ask = {**base, field: value}
            r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2,
                                                "vllm_xargs": {"tapc": json.dumps(ask)}})
            message = r.json().get("error", {}).get("message", "") if r.status_code == 400 else r.text
            if r.status_code != 400 or "\n" in message or field.rstrip("s") not in message:
                wrong.append((field, value, r.status_code, message[:200]))
        for body in WRONG_BODIES:
            r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, **body})
            if r.status_code != 400:
                wrong.append((body, r.status_code, r.text[:200]))
    assert wrong == []
    assert len(app.state.seen) == 1, "vLLM saw only the good one"


def test_over_http_patch_positions_past_int32_and_capture_null_are_400_in_one_line():
    app, _ = stand_in_app(TAPS)
    with client(app) as c:
        def post(**ask):
            return c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2,
                                                   "vllm_xargs": {"tapc": json.dumps(ask)}})
        r = post(params={"src": {"positions": [2**31], "rows": [[0.0] * HIDDEN]}})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "request to /v1/completions: parameter 'src' (rows) positions must be distinct non-negative token "
            "positions (1..256 of them, each up to 2147483647), got [2147483648]")
        r = post(capture=None)
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "request to /v1/completions: capture must be a capture's name, \"*\" or a list of them, got None")


def test_any_tapc_error_of_the_check_is_a_400(monkeypatch):
    """Not only RequestError: whatever TapcError checking raises is the request's."""
    from tapc.errors import ProtocolError
    from tapc.serving.server import TapcServer

    app, _ = stand_in_app(TAPS)

    def fails(self, body, where):
        raise ProtocolError(f"{where}: a field the wire cannot carry")

    monkeypatch.setattr(TapcServer, "admit", fails)
    with client(app) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "vllm_xargs": {"tapc": "{}"}})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "request to /v1/completions: a field the wire cannot carry"


# ----------------------------------------------------------------------------- what is accepted: its outputs


def generate(llm, ask, prompt=(1, 2, 3, 4, 5), max_tokens=3):
    return llm.generate([{"prompt_token_ids": list(prompt)}], SamplingParams(max_tokens=max_tokens), taps=ask)[0]


def test_values_past_float32_are_refused_and_values_inside_it_arrive_as_given():
    """1e39 would be inf in the float32 tables; float32's largest arrives as itself, and numpy's
    numbers count as numbers."""
    llm, _ = toy_vllm(["model.layers.1.resid | set(cols, vals)", "model.layers.1.resid",
                       "model.layers.2.resid | add(steer, alpha=alpha)", "model.layers.2.resid"])
    big = float(np.finfo(np.float32).max)
    out = generate(llm, TapRequest(capture="model.layers.1.resid", params={"cols": [3], "vals": big}))
    assert torch.equal(out.taps["model.layers.1.resid"][:, 3], torch.full((7,), big))
    for params, words in (({"cols": [3], "vals": 1e39}, "parameter 'vals' (values) must be a number or a list of "
                           "numbers, finite in float32 (its range is ±3.403e+38), got 1e+39"),
                          ({"steer": [1.0] * HIDDEN, "alpha": 1e39}, "parameter 'alpha' (scalar) must be a finite "
                           "number in float32 (its range is ±3.403e+38), got 1e+39"),
                          ({"steer": [1e300] * HIDDEN, "alpha": 1.0}, "parameter 'steer' (vector) has non-finite "
                           "entries in float32 (its range is ±3.403e+38), got [1e+300, ")):
        with pytest.raises(RequestError) as e:
            generate(llm, TapRequest(params=params))
        assert str(e.value).startswith(f"request 0: {words}"), e.value
    steer = np.linspace(-1, 1, HIDDEN)
    plain = generate(llm, TapRequest(capture="*", params={"steer": steer, "alpha": 2.0})).taps
    numpy = generate(llm, TapRequest(capture="*", params={"steer": steer.astype(np.float32), "alpha": np.float32(2.0)}))
    for key, value in plain.items():
        assert torch.equal(numpy.taps[key], value), key


def test_a_vector_of_flags_is_refused_and_one_of_integers_steers_as_its_floats():
    llm, _ = toy_vllm(["model.layers.2.resid", "model.layers.1.resid | add(steer)"])
    for flags in ([True, False] * (HIDDEN // 2), torch.ones(HIDDEN, dtype=torch.bool)):
        with pytest.raises(RequestError, match=f"^request 0: parameter 'steer' \\(vector\\) must be {HIDDEN} numbers"):
            generate(llm, TapRequest(params={"steer": flags}))
    ints = generate(llm, TapRequest(capture="*", params={"steer": torch.arange(HIDDEN)})).taps
    floats = generate(llm, TapRequest(capture="*", params={"steer": [float(i) for i in range(HIDDEN)]})).taps
    assert torch.equal(ints["model.layers.2.resid"], floats["model.layers.2.resid"])


def test_positions_are_bounded_before_they_are_read_and_an_empty_list_is_refused():
    llm, _ = toy_vllm(["model.layers.1.resid"])
    llm.session.max_model_len = 32
    t0 = time.perf_counter()
    with pytest.raises(RequestError) as e:
        generate(llm, TapRequest(capture="*", positions=range(10**9)))
    assert time.perf_counter() - t0 < 1 and str(e.value) == (
        "request 0: positions lists more than 31 positions, the most a request of max_model_len=32 has, "
        "got range(0, 1000000000)")
    with pytest.raises(RequestError, match=r"^request 0: positions \[\] lists no position; list one or more, or use "
                                           "one of all, prompt, generated, last$"):
        generate(llm, TapRequest(capture="*", positions=[]))
    ranged = generate(llm, TapRequest(capture="*", positions=range(2, 6))).taps["model.layers.1.resid"]
    listed = generate(llm, TapRequest(capture="*", positions=[2, 3, 4, 5])).taps["model.layers.1.resid"]
    assert ranged.shape == (4, HIDDEN) and torch.equal(ranged, listed)


def test_star_is_every_capture_the_request_can_have():
    """A request that does not apply a compiled function gets, for "*", every capture but the
    function's results: the same rows as naming them. One that applies it gets its results too;
    naming a result it cannot have stays an error."""
    taps = ["model.layers.1.resid | call(clamp)", "model.layers.*.resid"]
    plan = toy_plan(taps, functions={"clamp": clamp})
    runner, hooks = hooks_for(plan, ToyModel(), functions={"clamp": clamp})
    session = TapSession(plan)
    resid = [f"model.layers.{i}.resid" for i in range(LAYERS)]
    asks = {"star": TapRequest(capture="*"), "named": TapRequest(capture=resid),
            "applied": TapRequest(capture="*", params={"thr": 0.5})}
    prompt = [4, 8, 15, 16, 23]
    reqs = [Req(rid, prompt, 3, session.prepare(SamplingParams(max_tokens=3), session.check(ask, rid), rid).wire)
            for rid, ask in asks.items()]
    run(runner, reqs, budget=16)
    outs = collect(hooks, reqs, session)
    assert sorted(outs["star"].taps) == sorted(outs["named"].taps) == resid
    for key in resid:
        assert torch.equal(outs["star"].taps[key], outs["named"].taps[key]), key
    assert sorted(outs["applied"].taps) == sorted(resid + ["model.layers.1.resid:clamp.score"])
    with pytest.raises(RequestError, match="^r: model.layers.1.resid:clamp.score is a result of "
                                           "`model.layers.1.resid \\| call\\(clamp\\)`, which runs with the "
                                           "request's 'thr': bind them to capture it$"):
        session.check(TapRequest(capture=["*", "model.layers.1.resid:clamp.score"]), "r")
