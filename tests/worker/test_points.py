"""`logits` and `samples` around a sampler: captures, edits and blocks per request (CPU)."""
from types import SimpleNamespace as NS

import numpy as np
import torch
from engine_toy import VOCAB, toy_buffers, over_the_wire, toy_plan

from tapc.worker.layout import Layout
from tapc.worker.patches import sampler_patch
from tapc.worker.points import EnginePoints
from tapc.wire.protocol import Result, WireRequest
from tapc.api.requests import TapRequest, check
from tapc.worker.component import Step
from tapc.worker.step import StepBatch


class GreedySampler:
    def __call__(self, logits, input_batch):
        return NS(sampled_token_ids=logits.argmax(dim=-1, keepdim=True))


def setup(taps, asks):
    plan = toy_plan(taps)
    layout = Layout(plan)
    buffers = toy_buffers(layout, plan.max_num_batched_tokens, plan.max_num_seqs)
    points = EnginePoints(layout, buffers)
    sampler = GreedySampler()
    sampler_patch(sampler, points).apply()
    records = {}
    for slot, (rid, plen, ask) in enumerate(asks):
        wire = WireRequest(f"t-{rid}", check(plan, ask, rid))
        bound = [e for e, names in enumerate(layout.logit_edit_params) if names and all(n in wire.ask.params for n in names)]
        rec = NS(id=wire.id, rid=rid, prompt_len=plen, ask=wire.ask, params=wire.ask.params, slot=slot,
                 logit_edits=bound)
        buffers.logit_params.write(slot, bound, rec.params)   # as the runner does when it admits a request
        records[rid] = rec
        points.admit(rec, 0)
    return points, sampler, records


def taken(points, tid: str):
    """What the API gets for one request: (engine point tensors, saved values, block error),
    after the trip over the wire."""
    engine, saved, error = points.take(tid)
    result = Result.from_wire(over_the_wire(Result(tid, engine=engine, saved=saved, block_error=error).to_wire()))
    return {k: t.tensor() for k, t in result.engine.items()}, result.saved_values(), result.block_error


def step(points, sampler, records, sched):
    """sched: [(rid, tokens this step, computed before)] in batch order; returns sampled ids."""
    qsl = np.concatenate([[0], np.cumsum([n for _, n, _ in sched])])
    computed = np.array([c for _, _, c in sched])
    plens = np.array([records[r].prompt_len for r, _, _ in sched])
    batch = StepBatch([r for r, _, _ in sched], qsl, computed, plens, int(qsl[-1]))
    points.begin_step(Step(batch, [], records, set()))
    logits = torch.randn(len(sched), VOCAB, generator=torch.Generator().manual_seed(int(qsl[-1])))
    expected = logits.clone()
    return sampler(logits, None).sampled_token_ids.reshape(-1), expected


def test_logits_and_samples_captured_once_the_prompt_is_done():
    points, sampler, recs = setup(["logits", "samples"], [
        ("a", 3, TapRequest(capture=["logits", "samples"])), ("b", 10, TapRequest(capture="logits")),
        ("c", 2, TapRequest())])
    ids1, l1 = step(points, sampler, recs, [("a", 3, 0), ("b", 6, 0), ("c", 2, 0)])   # b: partial prefill
    ids2, l2 = step(points, sampler, recs, [("a", 1, 3), ("c", 1, 2), ("b", 4, 6)])
    a, _, _ = taken(points, recs["a"].id)
    torch.testing.assert_close(a["logits"], torch.stack([l1[0], l2[0]]))
    assert a["samples"].reshape(-1).tolist() == [ids1[0].item(), ids2[0].item()]
    b, _, _ = taken(points, recs["b"].id)
    torch.testing.assert_close(b["logits"], l2[2:3])   # only the step that finished its prompt
    assert "samples" not in b
    c, saved, error = taken(points, recs["c"].id)
    assert c == {} and saved == {} and error is None


def test_logits_mask_per_request_and_for_everyone():
    points, sampler, recs = setup(["logits | zero(banned)", "logits | set([7], value=-1000.0)", "logits"], [
        ("a", 2, TapRequest(capture="logits", params={"banned": [1, 2, 3]})), ("b", 2, TapRequest(capture="logits"))])
    _, raw = step(points, sampler, recs, [("a", 2, 0), ("b", 2, 0)])
    a = taken(points, recs["a"].id)[0]["logits"][0]
    b = taken(points, recs["b"].id)[0]["logits"][0]
    want_a, want_b = raw[0].clone(), raw[1].clone()
    want_a[[1, 2, 3]] = 0
    want_a[7] = want_b[7] = -1000.0
    torch.testing.assert_close(a, want_a)
    torch.testing.assert_close(b, want_b)


def test_samples_block_forces_a_token_for_its_request_only():
    def force(ctx, ids):
        ctx.save("was", ids.clone())
        ids.fill_(5)

    points, sampler, recs = setup(["samples -> force"], [("a", 2, TapRequest(blocks={"force": force})),
                                                          ("b", 2, TapRequest(blocks={"force": lambda ctx, ids: None}))])
    ids, raw = step(points, sampler, recs, [("a", 2, 0), ("b", 2, 0)])
    assert ids[0].item() == 5 and ids[1].item() == raw[1].argmax().item()
    saved = taken(points, recs["a"].id)[1]
    assert saved["was"][0].reshape(-1).item() == raw[0].argmax().item()


def test_logits_block_sees_one_row_with_its_position():
    # Blocks travel pickled (by value): what they keep goes through ctx.save, not a closed-over list.
    points, sampler, recs = setup(["logits -> look"], [("a", 4, TapRequest(blocks={
        "look": lambda ctx, x: ctx.save("seen", (ctx.request_id, ctx.positions.start, tuple(x.shape)))}))])
    step(points, sampler, recs, [("a", 4, 0)])
    step(points, sampler, recs, [("a", 1, 4)])
    seen = taken(points, recs["a"].id)[1]["seen"]
    assert seen == [("a", 3, (1, VOCAB)), ("a", 4, (1, VOCAB))]


def test_logits_edits_cover_the_rows_their_at_says():
    bias = np.random.default_rng(0).normal(size=VOCAB).astype(np.float32)
    points, sampler, recs = setup(["logits", "logits | add(bias, at=generated)", "logits | scale(f, at=last)"], [
        ("a", 3, TapRequest(capture="logits", params={"bias": bias, "f": 2.0})),
        ("b", 4, TapRequest(capture="logits", params={"f": 3.0}))])
    _, raw1 = step(points, sampler, recs, [("a", 3, 0), ("b", 4, 0)])    # the prompts' last rows
    _, raw2 = step(points, sampler, recs, [("b", 1, 4), ("a", 1, 3)])    # generated rows, b first
    a = taken(points, recs["a"].id)[0]["logits"]
    b = taken(points, recs["b"].id)[0]["logits"]
    torch.testing.assert_close(a, torch.stack([2.0 * raw1[0], raw2[1] + torch.from_numpy(bias)]))
    torch.testing.assert_close(b, torch.stack([3.0 * raw1[1], raw2[0]]))


def test_logits_edit_values_are_checked_as_in_graph_ones_are():
    import pytest

    from tapc.errors import RequestError

    plan = toy_plan(["logits | set(banned, value=w)"])
    with pytest.raises(RequestError, match="r: `logits | set\\(banned, value=w\\)` gives 2 values for 3 columns"):
        check(plan, TapRequest(params={"banned": [1, 2, 3], "w": [1.0, 2.0]}), "r")
    with pytest.raises(RequestError, match="binds 'banned' but not 'w'"):
        check(plan, TapRequest(params={"banned": [1, 2, 3]}), "r")
    with pytest.raises(RequestError, match="distinct column indices in 0..49"):
        check(plan, TapRequest(params={"banned": [50], "w": 1.0}), "r")
