"""The engine end to end on the CPU: install, per-step tables, request bookkeeping, assembly.

A toy model and scheduler (tests/support/engine_toy.py) stand in for vLLM; the tap ops run their torch
references. Every capture is compared with the toy model run on that request's tokens alone,
with plain forward hooks, and edits with the same edit applied by hand.
"""
import gc

import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, LAYERS, Req, Scheduler, ToyModel, collect, hooks_for, run, toy_plan, toy_vllm, wire_for
from toy_checks import TAPS, check, make_requests, reference

from tapc.wire.protocol import Ask, WireRequest
from tapc.api.requests import TapRequest
from tapc.errors import RequestError
from tapc.kernels.capture import PHASES
from tapc.api.session import TapSession
from tapc.worker.slots import EditSlots
from tapc.worker.tables import StepTables


RUNNERS = pytest.mark.parametrize("runner_kind", ["v2", "v1"])   # vLLM's model runners (runner_v*.py)


@RUNNERS
@pytest.mark.parametrize("compiled,fill", [(False, "numpy"), (False, "compiled"), (True, "compiled")],
                         ids=["eager, numpy fill", "eager", "compiled"])
def test_captures_equal_reference_under_continuous_batching(compiled, fill, runner_kind, monkeypatch):
    """Chunked prefill (budget 16 < a 25-token prompt), late arrivals, decode, padding to 8,
    a preemption with recompute, and five position options; on V1, requests in the persistent
    batch's slot order, which changes as requests leave. `fill`: the step fill by numpy, or as
    one compiled call (fill_jit.py, the engine's; the list of positions keeps numpy's)."""
    plan = toy_plan(TAPS)
    model = ToyModel()
    runner, hooks = hooks_for(plan, model, runner=runner_kind, compiled=fill == "compiled")
    if compiled:  # Dynamo must inline the patched forwards and keep the ops, without breaks
        runner.model = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    reqs = make_requests(plan)
    run(runner, reqs, budget=16)
    outs = collect(hooks, reqs, TapSession(plan))
    assert sorted(outs) == [r.rid for r in reqs if r.wire is not None]
    for r in reqs:
        if r.wire is not None:
            out = outs[r.rid]
            assert out.error is None and sorted(out.taps) == sorted(r.wire.ask.capture)
            check(r, dict(out.taps), r.wire.ask.positions)
    assert not hooks.by_id and not hooks.records


def test_a_listed_position_the_request_stopped_before_is_said_in_its_output():
    """Request "e" (9 prompt tokens, 4 generated) ran positions 0..11: its 40 has no row, and its
    output says so rather than coming back short without a word."""
    plan = toy_plan(TAPS)
    runner, hooks = hooks_for(plan, ToyModel())
    reqs = [r for r in make_requests(plan) if r.rid in ("a", "e")]
    run(runner, reqs, budget=16)
    outs = collect(hooks, reqs, TapSession(plan))
    assert outs["e"].error is None and outs["e"].taps.unreached == (40,) and outs["a"].taps.unreached == ()
    check(reqs[1], dict(outs["e"].taps), reqs[1].wire.ask.positions)


def test_a_worker_on_another_node_sends_rows_not_places_and_frees_its_arena():
    """A worker whose /dev/shm the API cannot see (another node: worker.py `_on_api_node`)
    answers collect with the rows themselves; the API's tensors are the same as from the arena,
    and the worker's arena holds nothing once collected."""
    plan = toy_plan(TAPS)
    got = {}
    for inline in (False, True):
        runner, hooks = hooks_for(plan, ToyModel(), inline=inline)
        reqs = make_requests(plan)
        run(runner, reqs, budget=16)
        session = TapSession(plan)
        outs = collect(hooks, reqs, session)
        got[inline] = {rid: {k: v.clone() for k, v in o.taps.items()} for rid, o in outs.items()}
        if inline:
            assert not hooks.arena.held, "an inline reply leaves no chunk behind on the worker"
            del outs
            gc.collect()
            assert session.released() == [], "nothing of the API's to give back"
        for r in reqs:
            if r.wire is not None:
                check(r, got[inline][r.rid], r.wire.ask.positions)
    for rid, taps in got[False].items():
        for k, v in taps.items():
            assert torch.equal(got[True][rid][k], v), (rid, k)


@RUNNERS
@pytest.mark.parametrize("compiled, many", [(False, 0), (True, 0), (False, 8)], ids=["eager", "compiled", "many"])
def test_rings_hold_steady_decode_rows_and_copy_them_out_whole(runner_kind, compiled, many, monkeypatch):
    """Steady decode runs in rings (rings.py): each step's rows land a phase on by the
    model's positions, and go out every PHASES steps or when the ring ends: an arrival, a
    preemption mid-ring, requests finishing, the collect. A request asking for part of a
    group's captures ("part") keeps the batch out of rings while it runs. With `many` more
    capturing requests in the batch. Every capture
    equals the reference, row for row; and copies are far fewer than steps."""
    monkeypatch.setenv("TAPC_RINGS", "1")
    plan = toy_plan(TAPS)
    model = ToyModel()
    runner, hooks = hooks_for(plan, model, rows=PHASES * (8 + many), runner=runner_kind)   # room for every ring
    if compiled:  # the ops' ring arguments through Dynamo, as vLLM's compiled graphs call them
        runner.model = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    whole = ["model.layers.*.resid", "model.layers.1.output[0]", "model.layers.2.mlp.down_proj.output"]   # a group
    asks = [("long", 6, 48, 0, None, TapRequest(capture="*")),
            ("gen", 9, 26, 0, 17, TapRequest(capture=whole, positions="generated")),
            ("part", 4, 6, 30, None, TapRequest(capture=["model.layers.1.output[0]"])),
            ("plain", 5, 33, 0, None, None)]
    asks += [(f"m{k}", 3 + k, 40, 0, None, TapRequest(capture=whole if k % 2 else "*")) for k in range(many)]
    rng = np.random.default_rng(11)
    reqs = [Req(rid, rng.integers(0, 50, plen).tolist(), n, wire_for(plan, ask, rid), arrive, preempt)
            for rid, plen, n, arrive, preempt, ask in asks]
    run(runner, reqs, budget=64)
    outs = collect(hooks, reqs, TapSession(plan))
    for r in reqs:
        if r.wire is not None:
            assert outs[r.rid].error is None
            check(r, dict(outs[r.rid].taps), r.wire.ask.positions)
    copies = hooks.component(StepTables).copy_out.copies
    assert hooks.steps > 40 and copies * 2 < hooks.steps, (copies, hooks.steps)
    assert not hooks.by_id and not hooks.records


@RUNNERS
@pytest.mark.parametrize("fill", ["numpy", "compiled"])
def test_steering_per_request_and_untouched_others(runner_kind, fill, monkeypatch):
    """Two requests with different vectors in one batch, one steered only while generating
    (a second tap on the same layer), one unsteered: each equals its own reference; the step
    fill by numpy, or as one compiled call (the engine's)."""
    # Taps at one module run in plan order: the edits first, so layer 1's capture sees them.
    plan = toy_plan(["model.layers.1.resid | add(steer, alpha=2.0)",
                     "model.layers.1.resid | add(late, alpha=-1.5, at=generated)", "model.layers.*.resid"])
    model = ToyModel()
    runner, hooks = hooks_for(plan, model, runner=runner_kind, compiled=fill == "compiled")
    rng = np.random.default_rng(1)
    v1, v2, v3 = (rng.standard_normal(HIDDEN) for _ in range(3))
    asks = {"s1": {"steer": v1}, "s2": {"steer": v2}, "plain": {}, "gen": {"late": v3}}
    reqs = []
    for i, (rid, params) in enumerate(asks.items()):
        wire = wire_for(plan, TapRequest(capture="*", params=params), rid)
        reqs.append(Req(rid, rng.integers(0, 50, 6 + 3 * i).tolist(), 4, wire))
    run(runner, reqs, budget=64)
    outs = collect(hooks, reqs, TapSession(plan))
    edits = {"s1": [(1, v1, 2.0, "all")], "s2": [(1, v2, 2.0, "all")], "plain": [], "gen": [(1, v3, -1.5, "generated")]}
    for r in reqs:
        check(r, dict(outs[r.rid].taps), "all", edits[r.rid])
    # The steering reached the layers after it, and the plain request is the unsteered model.
    s1 = outs["s1"].taps
    assert not torch.allclose(s1[f"model.layers.{LAYERS - 1}.resid"],
                              reference(reqs[0], [f"model.layers.{LAYERS - 1}.resid"])[f"model.layers.{LAYERS - 1}.resid"])
    assert hooks.component(EditSlots).slots.held == 0, "every parameter slot is back"


@RUNNERS
@pytest.mark.parametrize("slots", [8, 5])
def test_requests_with_equal_values_share_a_slot_written_once(runner_kind, slots, monkeypatch):
    """Twelve steered requests, arriving in turn, three sharing each of three vectors (before and
    after three with vectors of their own): each equals its own reference. With 8 slots each vector is
    written once; with 5, a slot nobody holds goes to other values and comes back rewritten."""
    plan = toy_plan(["model.layers.1.resid | add(steer, alpha=2.0)", "model.layers.*.resid"], slots=slots)
    runner, hooks = hooks_for(plan, ToyModel(), slots=slots, runner=runner_kind)
    writes = []
    params = hooks.component(StepTables).buffers.params
    write = params.write
    monkeypatch.setattr(params, "write", lambda slot, edits, values: (writes.append(slot), write(slot, edits, values)))
    rng = np.random.default_rng(7)
    shared = [rng.standard_normal(HIDDEN) for _ in range(3)]
    vecs = {f"r{i}": rng.standard_normal(HIDDEN) if 3 <= i < 6 else shared[i % 3] for i in range(12)}
    reqs = [Req(rid, rng.integers(0, 50, 4 + i).tolist(), 3 + i % 4,
                wire_for(plan, TapRequest(capture="*", params={"steer": v}), rid), arrive=i)
            for i, (rid, v) in enumerate(vecs.items())]
    run(runner, reqs, budget=64)
    outs = collect(hooks, reqs, TapSession(plan))
    for r in reqs:
        check(r, dict(outs[r.rid].taps), "all", [(1, vecs[r.rid], 2.0, "all")])
    if slots == 8:
        assert len(writes) == 6, f"3 shared vectors and 3 of their own: 6 writes, not one a request ({len(writes)})"
    else:
        assert 6 < len(writes) < 12, f"some slots were reused for other values, not every request wrote ({len(writes)})"
    assert hooks.component(EditSlots).slots.held == 0


def test_parameterless_edit_applies_to_every_request():
    plan = toy_plan(["model.layers.0.resid | scale(0.5, at=prompt)", "model.layers.2.resid"])
    runner, hooks = hooks_for(plan, ToyModel())
    rng = np.random.default_rng(2)
    reqs = [Req("x", rng.integers(0, 50, 5).tolist(), 3, wire_for(plan, TapRequest(capture="*"), "x")),
            Req("y", rng.integers(0, 50, 8).tolist(), 3, None)]
    run(runner, reqs, budget=64)
    taps = collect(hooks, reqs, TapSession(plan))["x"].taps
    # scale(0.5) of the residual stream, hand-made: add -0.5 * (h + r) on prompt rows.
    ref_model = ToyModel()
    toks = reqs[0].tokens[:-1]
    out = {}

    def hook(m, a, o):
        h, r = o
        h[:5] -= 0.5 * (h[:5] + r[:5])

    ref_model.model.layers[0].register_forward_hook(hook)
    ref_model.model.layers[2].register_forward_hook(lambda m, a, o: out.__setitem__("r", (o[0] + o[1]).detach()))
    with torch.no_grad():
        ref_model(torch.tensor(toks), torch.arange(len(toks)))
    torch.testing.assert_close(taps["model.layers.2.resid"], out["r"], rtol=1e-5, atol=1e-5)


def test_dummy_runs_see_tables_that_own_no_rows():
    plan = toy_plan(TAPS)
    runner, hooks = hooks_for(plan, ToyModel())
    reqs = make_requests(plan)[:2]
    reqs[0].max_tokens = 50
    run(runner, [reqs[1]], budget=64)
    table = hooks.component(StepTables).buffers.table
    table.fill_(7)
    runner.execute_model(_empty(), dummy_run=True)
    assert (table == -1).all()


def test_untapped_batches_own_no_rows_and_copy_nothing():
    """After a capturing request, untapped steps see tables that own no row (nothing stale from
    the earlier step) and write no pool row."""
    plan = toy_plan(TAPS)
    runner, hooks = hooks_for(plan, ToyModel())
    buffers = hooks.component(StepTables).buffers
    rng = np.random.default_rng(3)
    tapped = Req("t", rng.integers(0, 50, 9).tolist(), 2, wire_for(plan, TapRequest(capture="*"), "t"))
    run(runner, [tapped], budget=64)
    assert (buffers.table >= 0).any()
    collect(hooks, [tapped], TapSession(plan))
    for p in buffers.pools:
        p.fill_(0)
    run(runner, [Req("u", rng.integers(0, 50, 9).tolist(), 3, None)], budget=64)
    assert not hooks.by_id and not hooks.records
    assert (buffers.table == -1).all(), "the step's tables own no row"
    assert all((p == 0).all() for p in buffers.pools), "no pool row written"


@RUNNERS
def test_steps_that_own_no_row_upload_no_table_once_the_device_tables_own_none(runner_kind, monkeypatch):
    """Untapped steps skip the table upload only while the device's tables already own no row
    among the step's rows: the first untapped step after a tapped one clears them, a wider
    untapped step clears its wider rows, and a tapped request that joins later is served whole."""
    plan = toy_plan(TAPS)
    runner, hooks = hooks_for(plan, ToyModel(), runner=runner_kind)
    buffers = hooks.component(StepTables).buffers
    uploads, seen = [], []
    upload, begin = buffers.upload, hooks.begin_step

    def counted(padded, owns_rows=True):
        uploads.append((padded, owns_rows))
        upload(padded, owns_rows)

    def watched(batch):
        begin(batch)
        tapped = any(rid in hooks.records for rid in batch.req_ids)
        seen.append((batch.padded, tapped, bool((buffers.table[:, :batch.padded] == -1).all())))

    monkeypatch.setattr(buffers, "upload", counted)
    monkeypatch.setattr(hooks, "begin_step", watched)
    rng = np.random.default_rng(5)
    sched = Scheduler(runner, budget=64)   # one scheduler: finished requests leave V1's batch

    def serve(*reqs):
        for r in reqs:
            sched.add(r)
        while sched.busy():
            sched.step()

    untapped = lambda rid, n, m: Req(rid, rng.integers(0, 50, n).tolist(), m, None)
    serve(untapped("u0", 9, 3))
    assert uploads == [], "the tables start owning no row: nothing to upload"
    tapped = Req("t", rng.integers(0, 50, 21).tolist(), 3, wire_for(plan, TapRequest(capture="*"), "t"))
    serve(tapped)
    assert uploads and all(owns for _, owns in uploads)
    check(tapped, collect(hooks, [tapped], TapSession(plan))["t"].taps, "all")
    uploads.clear()
    seen.clear()
    serve(untapped("u1", 5, 4))      # prefill at 8 rows, then decode at 8
    serve(untapped("u2", 30, 2))     # a wider prefill: 32 rows
    assert all(clean for _, tapped, clean in seen if not tapped), f"an untapped step saw rows owned: {seen}"
    assert [p for p, _ in uploads] == [8, 32] and not any(owns for _, owns in uploads), uploads
    late = Req("t2", rng.integers(0, 50, 7).tolist(), 4, wire_for(plan, TapRequest(capture="*"), "t2"))
    serve(untapped("u3", 6, 6), late)
    check(late, collect(hooks, [late], TapSession(plan))["t2"].taps, "all")


@pytest.mark.parametrize("rings", ["1", "0"])
def test_a_collect_waits_for_its_requests_own_last_copies_not_the_newest_steps(rings, monkeypatch):
    """Collecting a request that finished while others run waits on the copy-out of its own last
    step (whose copies are long done), not on the newest step's: the host is not held until the
    newest forward ends. Its captures are whole. With rings, "b" alone from step 3
    is filled at step 3, starts a ring at step 4 and holds its rows from there in the ring until
    the first collect copies them out (copy 4); without, each step copies its own."""
    monkeypatch.setenv("TAPC_RINGS", rings)
    plan = toy_plan(TAPS)
    runner, hooks = hooks_for(plan, ToyModel())
    rng = np.random.default_rng(8)
    short = Req("a", rng.integers(0, 50, 5).tolist(), 2, wire_for(plan, TapRequest(capture="*"), "a"))
    long = Req("b", rng.integers(0, 50, 6).tolist(), 8, wire_for(plan, TapRequest(capture="*"), "b"))
    run(runner, [short, long], budget=64)   # both prefill in step 1; "a" finishes at step 2, "b" at 8
    copy_out = hooks.component(StepTables).copy_out
    assert copy_out.copies == (3 if rings == "1" else 8)
    got = collect(hooks, [short], TapSession(plan))
    assert copy_out.waited == [2], copy_out.waited
    check(short, got["a"].taps, "all")
    got = collect(hooks, [long], TapSession(plan))
    assert copy_out.waited == [2, 4 if rings == "1" else 8], copy_out.waited
    check(long, got["b"].taps, "all")


def test_worker_side_request_error_is_reported_at_collect():
    plan = toy_plan(TAPS)
    runner, hooks = hooks_for(plan, ToyModel())
    # As if sent by something other than the API: a capture the plan does not have.
    wire = WireRequest("t-bad", Ask(capture=("model.layers.9.resid",)))
    rng = np.random.default_rng(4)
    good = Req("good", rng.integers(0, 50, 5).tolist(), 2, wire_for(plan, TapRequest(capture="*"), "t-good"))
    reqs = [Req("bad", rng.integers(0, 50, 4).tolist(), 2, wire), good]
    run(runner, reqs, budget=64)
    outs = collect(hooks, reqs, TapSession(plan))
    assert isinstance(outs["bad"].error, RequestError)
    assert "capture 'model.layers.9.resid' is not in this engine's plan" in str(outs["bad"].error)
    assert outs["good"].error is None
    check(good, dict(outs["good"].taps), "all")


def test_a_request_failing_while_it_runs_fails_alone(no_room_past_8k):
    """Through `VLLM.generate`: one request's captures find no room in the arena (its first
    group fits, its second does not). It runs untapped with `out.error` saying why, and the
    requests around it, capturing and steering, come back whole. Nothing is left held: not
    the failed request's first chunk, nor a record of the request that only steers."""
    from vllm import SamplingParams

    from tapc import TapRequest

    steer = "model.layers.1.resid | add(steer, alpha=2.0)"
    llm, hooks = toy_vllm([steer, TAPS[3], *TAPS[:3]])   # the 24-wide group first
    rng = np.random.default_rng(5)
    v = rng.standard_normal(HIDDEN)
    prompts = [{"prompt_token_ids": rng.integers(0, 50, n).tolist()} for n in (6, 60, 8, 5)]
    asks = [TapRequest(capture="*"), TapRequest(capture="*"), TapRequest(capture="*", params={"steer": v}),
            TapRequest(params={"steer": v})]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3), taps=asks)

    assert isinstance(outs[1].error, RequestError) and "no room for its captures" in str(outs[1].error)
    with pytest.raises(KeyError, match="this request's taps failed: request r1: no room"):
        outs[1].taps["model.layers.0.resid"]
    for out, edits in ((outs[0], []), (outs[2], [(1, v, 2.0, "all")])):
        assert out.error is None
        req = Req(out.request_id, out.prompt_token_ids, 3, tokens=out.prompt_token_ids + out.outputs[0].token_ids)
        check(req, dict(out.taps), "all", edits)
    assert outs[3].error is None and outs[3].taps == {}
    with pytest.raises(KeyError, match="not captured for this request; it has nothing"):
        outs[3].taps["model.layers.0.resid"]
    assert not hooks.by_id and not hooks.records and not hooks.errors
    del outs, out  # the loop variable holds a request too
    gc.collect()
    llm._give_back()
    assert not hooks.arena.held, "every chunk is back once the caller drops its captures"


def test_a_capture_that_cannot_grow_fails_its_request_alone(no_room_past_8k, monkeypatch):
    """A request whose storage must grow mid-run and finds no room stops capturing and fails at
    collect, with its chunks given back; the request beside it in the same steps is whole."""
    from vllm import SamplingParams

    from tapc import TapRequest
    from tapc.worker import records

    llm, hooks = toy_vllm(TAPS)
    # The first allocation sized for 2 rows: the 20-token prompt must grow by 64 rows (20 kB).
    real = records.expected_rows
    monkeypatch.setattr(records, "expected_rows", lambda at, plen, gen: 2 if plen == 20 else real(at, plen, gen))
    rng = np.random.default_rng(6)
    prompts = [{"prompt_token_ids": rng.integers(0, 50, n).tolist()} for n in (20, 6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4), taps=TapRequest(capture="*"))
    assert isinstance(outs[0].error, RequestError) and "no room for its captures" in str(outs[0].error)
    assert outs[1].error is None
    req = Req(outs[1].request_id, outs[1].prompt_token_ids, 4,
              tokens=outs[1].prompt_token_ids + outs[1].outputs[0].token_ids)
    check(req, dict(outs[1].taps), "all")
    del outs
    gc.collect()
    llm._give_back()
    assert not hooks.arena.held and not hooks.by_id


def _empty():
    from types import SimpleNamespace as NS

    return NS(scheduled_new_reqs=[], finished_req_ids=set(), preempted_req_ids=set(), num_scheduled_tokens={})


def test_session_pieces_serve_requests_one_at_a_time():
    """The steps an async engine or a server route takes with the session, per request: each
    prepared on its own, submitted together, collected and finished separately in another
    order; a cancelled one collected and discarded. Every chunk goes back in the end."""
    from vllm import SamplingParams

    llm, hooks = toy_vllm(TAPS)
    session, engine = llm.session, llm.llm
    rng = np.random.default_rng(7)
    asks = [TapRequest(capture="*"), TapRequest(capture="model.layers.1.resid", positions="prompt"), None,
            TapRequest(capture="*")]
    prepared = [session.prepare(SamplingParams(max_tokens=3 + i), session.check(ask, f"request {i}"), f"request {i}")
                for i, ask in enumerate(asks)]
    assert prepared[2].wire is None and len({p.id for p in prepared}) == 4
    outs = engine.generate([{"prompt_token_ids": rng.integers(0, 50, n).tolist()} for n in (5, 9, 4, 6)],
                           [p.params for p in prepared])
    cancelled = prepared.pop()
    reply = engine.collective_rpc("tapc_collect", args=(session.wanted([cancelled]),))[0]
    session.discard(session.results(reply)[cancelled.id])
    for out, p in reversed(list(zip(outs, prepared))):
        reply = engine.collective_rpc("tapc_collect", args=(session.wanted([p]),))[0] if p.wire else None
        session.finish(out, p.wire, None if reply is None else session.results(reply).get(p.id))
        assert out.error is None
        if p.wire is not None:
            req = Req(out.request_id, out.prompt_token_ids, 0, tokens=out.prompt_token_ids + out.outputs[0].token_ids)
            check(req, dict(out.taps), p.wire.ask.positions)
    assert outs[2].taps == {} and not hooks.by_id and not hooks.records
    del outs, out
    gc.collect()
    llm._give_back()
    assert not hooks.arena.held, "the cancelled request's chunks and the dropped captures are back"
def test_an_element_of_a_one_tensor_output_is_refused_when_it_runs():
    """Defence behind the tree's per-call-site arity: if a plan says a module returns a tuple
    where it returns one tensor, the forward raises instead of capturing that tensor as `[1]`."""
    import dataclasses

    from engine_toy import toy_tree

    from tapc.errors import EngineError
    from tapc.plan.planner import build_plan

    tree = toy_tree()
    wrong = tuple(dataclasses.replace(n, output="norm") if n.path == "model.layers.1.mlp" else n for n in tree.nodes)
    plan = build_plan("toy", ["model.layers.1.mlp.output[1]"], max_num_batched_tokens=64, max_num_seqs=8,
                      tree=dataclasses.replace(tree, nodes=wrong))
    model = ToyModel()
    hooks_for(plan, model)
    with pytest.raises(EngineError, match=r"`model.layers.1.mlp.output\[1\]`: `model.layers.1.mlp` returned one tensor"):
        model(torch.tensor([1, 2, 3]), torch.arange(3))


@RUNNERS
def test_a_steered_request_keeps_its_edit_across_a_preemption(runner_kind):
    """Preempted mid-generation and recomputed from 0: it gives back its parameter slot, takes
    one again when it resumes (V2: among the new requests; V1: among the cached ones) and its
    captures, edited, equal the reference; the other steered request keeps its own vector."""
    plan = toy_plan(["model.layers.1.resid | add(steer, alpha=2.0)", "model.layers.*.resid"])
    runner, hooks = hooks_for(plan, ToyModel(), runner=runner_kind)
    rng = np.random.default_rng(5)
    vs = {rid: rng.standard_normal(HIDDEN) for rid in ("p", "q")}
    reqs = [Req("p", rng.integers(0, 50, 9).tolist(), 6, wire_for(plan, TapRequest(capture="*", params={"steer": vs["p"]}), "p"),
                preempt_at=4),
            Req("q", rng.integers(0, 50, 5).tolist(), 8, wire_for(plan, TapRequest(capture="*", params={"steer": vs["q"]}), "q"),
                arrive=5)]
    run(runner, reqs, budget=64)
    outs = collect(hooks, reqs, TapSession(plan))
    for r in reqs:
        check(r, dict(outs[r.rid].taps), "all", [(1, vs[r.rid], 2.0, "all")])
    assert hooks.component(EditSlots).slots.held == 0


def test_v1_step_batch_is_the_persistent_batchs_first_requests():
    """V1's input batch holds more slots than requests; the step is its first num_reqs, in its
    order, with its host query_start_loc, computed tokens and prompt lengths."""
    from types import SimpleNamespace as NS

    from tapc.worker.runner_v1 import step_batch

    batch = NS(num_reqs=3, req_ids=["c", "a", "b"], num_computed_tokens_cpu=np.array([7, 0, 12, 99], dtype=np.int32),
               num_prompt_tokens=np.array([5, 20, 12, 99], dtype=np.int32))
    qsl = np.array([0, 1, 17, 18, 18, 18], dtype=np.int32)
    step = step_batch(batch, qsl, 24)
    assert list(step.req_ids) == ["c", "a", "b"] and step.padded == 24
    assert step.query_start_loc.tolist() == [0, 1, 17, 18]
    assert step.num_computed.tolist() == [7, 0, 12] and step.prompt_lens.tolist() == [5, 20, 12]
    with pytest.raises(Exception, match="empty slot"):
        step_batch(NS(**{**vars(batch), "req_ids": ["c", None, "b"]}), qsl, 24)


def test_v1_dummy_runs_see_tables_that_own_no_rows():
    """V1 profiles, warms up and captures graphs through `_dummy_run`: the tables the last real
    step filled must not send a dummy forward's rows into anyone's captures."""
    plan = toy_plan(["model.layers.1.resid"])
    runner, hooks = hooks_for(plan, ToyModel(), runner="v1")
    rng = np.random.default_rng(6)
    reqs = [Req("a", rng.integers(0, 50, 9).tolist(), 3, wire_for(plan, TapRequest(capture="*"), "a"), arrive=0),
            Req("b", rng.integers(0, 50, 30).tolist(), 2, wire_for(plan, TapRequest(capture="*"), "b"), arrive=0)]
    run(runner, reqs, budget=16)
    table = hooks.component(StepTables).buffers.table
    assert (table >= 0).any(), "the last step's rows are still in the table"
    runner._dummy_run(8)
    assert runner.dummy_runs == 1 and not (table >= 0).any()
