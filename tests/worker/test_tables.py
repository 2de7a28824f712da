"""The step fill and host storage against a reference; request checks and engine arguments:
every error with its words."""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, INTER, toy_plan

from places import CONFIGS
from tapc.plan.planner import build_plan
from tapc.api.engine_args import WORKER, engine_kwargs
from tapc.plan.tapplan import TapPlan
from tapc.wire.config import EngineConfig
from tapc.worker.fill import fill_step, tapped_of
from tapc.worker.rings import Repeat
from tapc.kernels.capture import PHASES
from tapc.worker.layout import Layout
from tapc.worker.segmentcopy import copy_segments
from tapc.wire.positions import expected_rows, interval, select
from tapc.wire.protocol import WireRequest
from tapc.worker.records import Record
from tapc.api.requests import TapRequest, check
from tapc.worker.slots import Slots
from tapc.worker.step import StepBatch
from tapc.worker.storage import Store
from tapc.errors import EngineError, RequestError, TapcError

PLAN_TAPS = ["model.layers.*.resid", "model.layers.1.mlp.up_proj.output",
             "model.layers.2.resid | add(steer, alpha=a)", "model.layers.0.resid | set([1, 2], 1.5)",
             "model.layers.1.resid | zero(cols)", "model.layers.*.mlp.output | add(steer, alpha=a, at=generated)",
             "model.layers.0.mlp.up_proj.output | scale(2.0, at=prompt)", "model.layers.2.mlp.up_proj.output | add(steer2, at=last)"]


def cpu_alloc(rows, caps, width, dtype):
    return torch.zeros(rows, caps, width, dtype=dtype)


def test_select_positions():
    pos = np.arange(2, 9)
    assert select("all", pos, 5).all()
    assert pos[select("prompt", pos, 5)].tolist() == [2, 3, 4]
    assert pos[select("generated", pos, 5)].tolist() == [5, 6, 7, 8]
    assert pos[select("last", pos, 5)].tolist() == [4]
    assert pos[select([0, 3, 8], pos, 5)].tolist() == [3, 8]


def test_a_words_interval_covers_what_select_covers():
    """The fill's closed form of a word (`interval`) against `select`, over positions around
    short, empty and long prompts; a list of positions has none."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        plen = int(rng.integers(0, 12))
        pos = np.arange(int(rng.integers(0, 4)), int(rng.integers(4, 30)))
        for word in ("all", "prompt", "generated", "last"):
            lo, hi = interval(word, plen)
            assert ((pos >= lo) & (pos < hi)).tolist() == select(word, pos, plen).tolist(), (word, plen)
    assert interval([0, 3], 5) is None


@pytest.mark.parametrize("positions,rows", [("all", 7), ("prompt", 5), ("generated", 2), ("last", 1), ([1, 6, 7], 2)])
def test_expected_rows(positions, rows):
    # 5 prompt tokens, 3 generated: positions 0..6 went through the model.
    assert expected_rows(positions, 5, 3) == rows


def test_expected_rows_counts_what_select_covers():
    """The closed form against `select`'s mask over the positions that ran, for every kind of
    `positions` and short, empty and long prompts and outputs (lists with repeats and positions
    out of range)."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        plen, gen = int(rng.integers(0, 12)), int(rng.integers(0, 12))
        listed = rng.integers(-3, 30, size=int(rng.integers(0, 8))).tolist()
        for positions in ("all", "prompt", "generated", "last", listed):
            ran = np.arange(plen + max(gen, 1) - 1)
            want = int(select(positions, ran, plen).sum())
            assert expected_rows(positions, plen, gen) == want, (positions, plen, gen)


def device_step(layout: Layout, table: np.ndarray, padded: int, pools: list[torch.Tensor],
                acts: list[torch.Tensor]) -> None:
    """What the capture ops do with a filled table in a forward of `padded` rows: capture c puts
    row r of its activation at row table[c, r] of its group's pool (tapc/kernels/capture.py); -1
    skips the row."""
    for c in range(len(layout.captures)):
        rows = np.flatnonzero(table[c, :padded] >= 0)
        pools[int(layout.cap_group[c])][torch.from_numpy(table[c, rows].astype(np.int64))] = acts[c][rows]


@pytest.mark.parametrize("few", ["numpy", "compiled"])
@pytest.mark.parametrize("seed", range(4))
def test_fill_puts_every_selected_row_in_its_request_storage_and_edits_exactly_the_rows_at_covers(seed, few):
    """Random requests (capture subsets, positions, bound parameters, untapped ones) over
    random steps (chunked prefill, decode, batch order shuffled, padding): each request's host
    storage ends with the activations of its selected positions, in order, each once; and in
    every step an edit's table names the request's slot on exactly the rows its `at` covers,
    for the requests that bind it (every request for a literal edit), and nothing else. Both
    fills: numpy's (fill.py), and the compiled one (fill_jit.py) as the step tables call it,
    fill.py's taking the steps it returns None for: those with a list of positions)."""
    from tapc.worker import fill
    from tapc.worker.fill_jit import CompiledFill

    if few == "compiled":
        compiled, ran = CompiledFill(Layout(toy_plan(PLAN_TAPS, rows=256))), []

        def fill_step(layout, table, tapped, batch):
            got = compiled(table, tapped, batch)
            ran.append(got is not None)
            return got or fill.fill_step(layout, table, tapped, batch)
    else:
        fill_step = fill.fill_step
    rng = np.random.default_rng(seed)
    plan = toy_plan(PLAN_TAPS, rows=256)
    layout = Layout(plan)
    keys = [t.key for t in layout.captures]
    slots = Slots(8)
    reqs = []
    for i in range(6):
        plen, gen = int(rng.integers(1, 20)), int(rng.integers(1, 6))
        untapped = i == 5
        capture = [] if untapped else list(rng.choice(keys, size=int(rng.integers(0, len(keys) + 1)), replace=False))
        positions = [str(p) for p in ("all", "prompt", "generated", "last")] + ["list"]
        at = positions[int(rng.integers(0, len(positions)))]
        at = sorted(rng.choice(plen + gen, size=3, replace=False).tolist()) if at == "list" else at
        params = {}
        if rng.random() < 0.5:
            params.update(steer=rng.standard_normal(HIDDEN), a=1.0)
        if rng.random() < 0.5:
            params.update(cols=[1, 3])
        if rng.random() < 0.5:
            params.update(steer2=rng.standard_normal(INTER))
        rec = None
        if not untapped:
            wire = WireRequest(f"t{i}", check(plan, TapRequest(capture=capture, positions=at, params=params), f"r{i}"))
            rec = Record(layout, f"r{i}", wire, plen, gen, cpu_alloc)
            rec.slot = slots.take()[0] if rec.edits else -1
        reqs.append(dict(rid=f"r{i}", plen=plen, total=plen + gen - 1, done=0, rec=rec, seen={}, capture=capture))
    records = {r["rid"]: r["rec"] for r in reqs if r["rec"] is not None}
    table = np.zeros((layout.table_rows, 256), dtype=np.int32)
    pools = [torch.zeros(len(g.caps) * 256, g.width) for g in layout.groups]
    while any(r["done"] < r["total"] for r in reqs):
        live = [r for r in reqs if r["done"] < r["total"]]
        live = [live[k] for k in rng.permutation(len(live))]
        counts = [min(int(rng.integers(1, 8)), r["total"] - r["done"]) for r in live]
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        padded = -(-int(qsl[-1]) // 8) * 8 + 8 * int(rng.integers(0, 2))
        batch = StepBatch([r["rid"] for r in live], qsl, np.array([r["done"] for r in live], dtype=np.int32),
                          np.array([r["plen"] for r in live], dtype=np.int32), padded)
        table[:] = 7   # stale values from an earlier step
        segments, _ = fill_step(layout, table, tapped_of(records, batch), batch)
        acts = [torch.randn(256, t.width, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
                for t in layout.captures]
        device_step(layout, table, padded, pools, acts)
        copy_segments(segments, pools)
        for e, tap in enumerate(layout.edits):
            want = np.full(padded, -1)
            for i, r in enumerate(live):
                rec = r["rec"]
                slot = 0 if e in layout.always else (rec.slot if rec is not None and e in rec.edits else -1)
                pos = np.arange(r["done"], r["done"] + counts[i])
                rows = np.arange(qsl[i], qsl[i + 1])[select(layout.edit_at[e], pos, r["plen"])]
                want[rows] = slot
            assert table[layout.edit_row(e), :padded].tolist() == want.tolist(), f"`{tap.source}`"
        for i, r in enumerate(live):
            for k in range(counts[i]):
                r["seen"].setdefault(r["done"] + k, [a[qsl[i] + k] for a in acts])
            r["done"] += counts[i]
        assert (table[:len(layout.captures), qsl[-1]:padded] == -1).all(), "padding is never captured"
    checked = 0
    for r in reqs:
        rec = r["rec"]
        if rec is None:
            continue
        assert sorted(layout.captures[c].key for st in rec.stores for c in st.caps) == sorted(r["capture"])
        pos = np.arange(r["total"])
        chosen = pos[select(rec.positions, pos, r["plen"])]
        for st in rec.stores:
            got = torch.cat([chunk[:n] for chunk, n in st.filled()])
            want = torch.stack([torch.stack([r["seen"][p][c] for c in st.caps]) for p in chosen.tolist()]) \
                if chosen.size else got[:0]
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{r['rid']} group {st.group}: {m}")
            checked += got.shape[0]
    assert checked, "the scenario captured something"
    if few == "compiled":
        assert any(ran), "the compiled fill took some steps"


@pytest.mark.parametrize("seed", range(3))
def test_a_repeated_decode_step_leaves_the_tables_segments_and_captures_of_a_fresh_fill(seed):
    """Steady decode with arrivals, departures, 1-row recompute steps (a preempted request's
    rows seen before), speculative-decoding steps (three rows for a request one position on)
    and requests asking for position lists: a run that keeps the device's
    tables and the segments when a step repeats the last (`Repeat`, as the runner hooks use it)
    has, at every step, the device tables and segments of a run that fills every step, and
    ends with the same captures; and steps did repeat."""
    rng = np.random.default_rng(seed)
    plan = toy_plan(PLAN_TAPS, rows=256)
    layout = Layout(plan)
    keys = [t.key for t in layout.captures]
    specs = []
    for i in range(6):
        positions = ["all", "generated", "prompt", "last", [0, 9, 14]][i % 5]
        params = {"steer": rng.standard_normal(HIDDEN), "a": 1.0} if i % 2 else {}
        specs.append(dict(rid=f"r{i}", plen=int(rng.integers(2, 6)), gen=int(rng.integers(12, 20)),
                          ask=TapRequest(capture=list(rng.choice(keys, size=3, replace=False)), positions=positions,
                                         params=params)))
    runs = []
    for repeat in (None, Repeat()):
        slots = Slots(8)
        records = {}
        for sp in specs:
            wire = WireRequest(sp["rid"], check(plan, sp["ask"], sp["rid"]))
            rec = records[sp["rid"]] = Record(layout, sp["rid"], wire, sp["plen"], sp["gen"], cpu_alloc)
            rec.slot = slots.take()[0] if rec.edits else -1
        runs.append(dict(repeat=repeat, records=records, device=np.full((layout.table_rows, 256), -1, np.int32),
                         pools=[torch.zeros(len(g.caps) * 256, g.width) for g in layout.groups], hits=0))
    done = {sp["rid"]: 0 for sp in specs}
    live = [sp for sp in specs[:4]]
    step = 0
    while live:
        step += 1
        arriving = next((sp for sp in specs if sp not in live and done[sp["rid"]] == 0), None)
        if step % 9 == 0 and arriving is not None:   # an arrival: this step changes the batch
            live.append(arriving)
        counts = [sp["plen"] if done[sp["rid"]] == 0 else 1 for sp in live]
        recompute = step % 11 == 0 and done[live[0]["rid"]] > live[0]["plen"]
        if step % 7 == 0 and not recompute and done[live[-1]["rid"]] > live[-1]["plen"]:
            counts[-1] = 3   # a speculative-decoding step: one row and two drafts, one position on
        computed = [done[sp["rid"]] - (2 if recompute and k == 0 else 0) for k, sp in enumerate(live)]
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        batch = StepBatch([sp["rid"] for sp in live], qsl, np.array(computed, dtype=np.int32),
                          np.array([sp["plen"] for sp in live], dtype=np.int32), -(-int(qsl[-1]) // 8) * 8)
        acts = [torch.randn(256, t.width, generator=torch.Generator().manual_seed(step * 100 + c))
                for c, t in enumerate(layout.captures)]
        seen = []
        for run in runs:
            got = run["repeat"].same(batch) if run["repeat"] is not None else None
            if got is None:
                table = np.full((layout.table_rows, batch.padded), 7, np.int32)
                tapped = tapped_of(run["records"], batch)
                got = fill_step(layout, table, tapped, batch)
                run["device"][:, :batch.padded] = table            # the upload
                if run["repeat"] is not None:
                    run["repeat"].keep(batch, tapped, got)
            else:
                run["hits"] += 1
            device_step(layout, run["device"], batch.padded, run["pools"], acts)
            copy_segments(got[0], run["pools"])
            seen.append((run["device"][:, :batch.padded].copy(),
                         [(seg.store.group, seg.store.caps_key, seg.start, seg.rows) for seg in got[0]], got[1]))
        assert np.array_equal(seen[0][0], seen[1][0]), f"step {step}: the device's tables"
        assert seen[0][1:] == seen[1][1:], f"step {step}: segments and pool rows used"
        for k, sp in enumerate(live):
            done[sp["rid"]] = computed[k] + counts[k]   # a recompute step goes back a row
        leaving = [sp for sp in live if done[sp["rid"]] >= sp["plen"] + sp["gen"] - 1]
        if leaving or recompute:
            for run in runs:
                if run["repeat"] is not None:
                    run["repeat"].forget()   # as schedule() does when requests finish or resume
        live = [sp for sp in live if sp not in leaving]
    # (none repeat while the request asking for a position list runs)
    assert runs[1]["hits"] >= 5, f"{runs[1]['hits']} of {step} steps repeated"
    for rid in runs[0]["records"]:
        for a, b in zip(runs[0]["records"][rid].stores, runs[1]["records"][rid].stores):
            assert a.rows == b.rows and a.rows > 0 or rid in ("r2", "r3")
            torch.testing.assert_close(torch.cat([c[:n] for c, n in a.filled()]),
                                       torch.cat([c[:n] for c, n in b.filled()]), rtol=0, atol=0)


def test_store_keeps_rows_in_order_when_it_grows_past_its_first_chunk():
    st = Store(0, np.array([0, 1]), 3, torch.float32, cpu_alloc, first=10)
    rows = torch.randn(80, 2, 3, generator=torch.Generator().manual_seed(0))   # row r of the request
    done = 0
    for n in (6, 6, 3, 0, 17):
        first = st.take(n)
        assert first == done
        places = st.span(first, n)
        if places and first >= st.last_base:   # in the last chunk: the address the batched copy uses
            chunk, lo, _ = places[0]
            assert st.last_ptr + (first - st.last_base) * st.row_bytes == chunk[lo].data_ptr()
        src = rows[done: done + n]
        assert sum(k for _, _, k in places) == n
        for chunk, lo, k in places:
            chunk[lo: lo + k] = src[:k]
            src = src[k:]
        done += n
    assert len(st.chunks) > 1, "it grew"
    assert torch.equal(torch.cat([c[:n] for c, n in st.filled()]), rows[:done]), "every row where it belongs, in order"


def test_slots_run_out_loudly():
    slots = Slots(1)
    slots.take()
    with pytest.raises(EngineError, match="parameter slots are taken"):
        slots.take()


def test_slots_share_equal_values_and_keep_them_after_use():
    slots = Slots(2)
    a, fresh_a = slots.take("v1")
    b, fresh_b = slots.take("v1")
    assert (a, fresh_a, fresh_b) == (b, True, False), "equal values: one slot, written once"
    c, fresh_c = slots.take("v2")
    assert c != a and fresh_c and slots.held == 2
    with pytest.raises(EngineError, match="parameter slots are taken"):
        slots.take("v3")
    for s in (a, b, c):
        slots.give(s)
    assert slots.held == 0
    assert slots.take("v1") == (a, False), "a slot nobody holds keeps its values for the next request"
    # v2's slot is the least recently used idle one: v3 takes it, and v2 must be written again
    assert slots.take("v3") == (c, True)
    slots.give(c)
    assert slots.take("v2") == (c, True)
    mine, fresh = Slots(1).take()
    assert fresh, "values shared with no one are always written"


@pytest.mark.parametrize("ask,words", [
    (TapRequest(capture="model.layers.1.resdi"), "did you mean 'model.layers.1.resid'"),
    (TapRequest(capture=["model.layers.7.resid"]), "not a capture of this engine's plan"),
    (TapRequest(capture="*", positions="middle"), "positions 'middle'"),
    (TapRequest(capture="*", positions=[3, 3]), "distinct non-negative"),
    (TapRequest(params={"stear": [0.0] * HIDDEN}), "parameter 'stear' is not named by any tap"),
    (TapRequest(params={"steer": [0.0] * 3, "a": 1.0}), "must be 16 numbers"),
    (TapRequest(params={"steer": [float("nan")] * HIDDEN, "a": 1.0}), "non-finite"),
    (TapRequest(params={"steer": [0.0] * HIDDEN}), "binds 'steer' but not 'a'"),
    (TapRequest(params={"steer": [0.0] * HIDDEN, "a": "big"}), "must be a finite number"),
    (TapRequest(params={"cols": [1, 99]}), "distinct column indices in 0..15"),
])
def test_request_errors(ask, words):
    with pytest.raises(RequestError, match="request 2: .*" + words.replace("(", r"\(").replace(")", r"\)")):
        check(toy_plan(PLAN_TAPS), ask, "request 2")


def test_request_by_tap_line_expands_the_glob():
    ask = check(toy_plan(PLAN_TAPS), TapRequest(capture="model.layers.*.resid", params={"cols": 3}), "r")
    assert ask.capture == tuple(f"model.layers.{i}.resid" for i in range(3))
    assert ask.params == {"cols": [3]} and ask.positions == "all"


def test_engine_kwargs():
    plan = toy_plan(PLAN_TAPS, rows=64, slots=8)
    kw, config = engine_kwargs(plan, {"max_num_batched_tokens": 64, "additional_config": {"mine": 1}})
    assert kw["worker_cls"] == WORKER and "enable_prefix_caching" not in kw and kw["max_num_seqs"] == 8
    assert kw["additional_config"]["mine"] == 1 and EngineConfig.read(kw["additional_config"]) == config
    assert plan.digest != config.graph_digest and TapPlan.from_json(config.plan) == plan


def test_rings_reach_the_workers_in_the_plans_config_which_vllm_hashes(monkeypatch):
    """Rings are on unless the API's environment sets TAPC_RINGS=0: on or off, `rings` says so in
    the engine's config (the workers read it there, and vLLM's compile-cache key covers it: rings
    change the capture ops' arguments); another value is refused."""
    plan = toy_plan(PLAN_TAPS, slots=8)
    monkeypatch.delenv("TAPC_RINGS", raising=False)
    assert engine_kwargs(plan, {})[1].rings is True
    monkeypatch.setenv("TAPC_RINGS", "0")
    assert engine_kwargs(plan, {})[1].rings is False
    monkeypatch.setenv("TAPC_RINGS", "yes")
    with pytest.raises(TapcError, match="TAPC_RINGS='yes': 1 \\(the default\\) or 0"):
        engine_kwargs(plan, {})


def test_capture_memory_reaches_the_workers_in_the_plans_config_and_not_vllm():
    plan = toy_plan(PLAN_TAPS, slots=8)
    kw, config = engine_kwargs(plan, {"capture_memory_gib": 1.5})
    assert "capture_memory_gib" not in kw and config.capture_memory == 3 << 29
    assert engine_kwargs(plan, {"capture_memory_gib": None})[1].capture_memory == 0


@pytest.mark.parametrize("kwargs,words", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 but the plan was built for 1"),
    ({"worker_cls": "my.Worker"}, "runs tapc's worker"),
    ({"max_num_seqs": 9}, "plan was built for 8"),
    ({"capture_memory_gib": -1}, "capture_memory_gib=-1: give the GiB .* a number >= 0"),
    ({"capture_memory_gib": "8"}, "capture_memory_gib='8'"),
    ({"capture_memory_gib": float("nan")}, "capture_memory_gib=nan"),
    ({"capture_memory_gib": True}, "capture_memory_gib=True"),
])
def test_engine_kwargs_refuse(kwargs, words):
    with pytest.raises(EngineError, match=words):
        engine_kwargs(toy_plan(PLAN_TAPS, slots=8), kwargs)


@pytest.mark.parametrize("backend,kept", [(None, "mp"), ("mp", "mp"), ("ray", "ray")])
def test_several_gpus_run_on_vllms_multiprocessing_or_ray_executor(backend, kept):
    plan = build_plan(str(CONFIGS / "llama"), ["model.layers.0.resid"], max_num_batched_tokens=64, max_num_seqs=8,
                      engine_args={"tensor_parallel_size": 2})
    kw, _ = engine_kwargs(plan, {"tensor_parallel_size": 2, "distributed_executor_backend": backend})
    assert kw["distributed_executor_backend"] == kept
    with pytest.raises(EngineError) as refused:
        engine_kwargs(plan, {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"})
    assert str(refused.value) == ("distributed_executor_backend='uni': tapped engines on several GPUs run vLLM's "
                                  "multiprocessing executor (\"mp\", the default) or its Ray executor (\"ray\") "
                                  "(docs/distributed.md)")


def test_expert_parallelism_is_refused_in_one_line_by_the_engine_and_by_tapc_serve(capsys):
    """Router and expert taps under expert parallelism are not built: `enable_expert_parallel`
    is refused where a tapped engine's arguments are made, and as `tapc serve`'s vLLM flag."""

    from tapc.cli import main

    words = ("enable_expert_parallel: a tapped engine does not run expert parallelism yet (router and expert taps "
             "under it are not built); leave it off: tensor parallelism runs MoE models (docs/distributed.md)")
    with pytest.raises(EngineError) as refused:
        engine_kwargs(toy_plan(PLAN_TAPS), {"enable_expert_parallel": True})
    assert str(refused.value) == words
    assert engine_kwargs(toy_plan(PLAN_TAPS), {"enable_expert_parallel": False})[0]["worker_cls"] == WORKER
    for flag in ("--enable-expert-parallel", "-ep"):
        assert main(["serve", str(CONFIGS / "llama"), "--tap", "model.layers.0.resid", "--print", flag]) == 2
        assert capsys.readouterr().err == f"tapc: EngineError: {words}\n"


def test_v1_runner_is_allowed(monkeypatch):
    """VLLM_USE_V2_MODEL_RUNNER=0 (vLLM's V1 runner, as for MoE models) reaches the worker, which
    instruments V1 (runner_v1.py)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert engine_kwargs(toy_plan(PLAN_TAPS), {})[0]["worker_cls"] == "tapc.worker.worker.TapWorker"


def test_another_runner_is_refused_by_the_worker():
    from engine_toy import ToyRunner

    from tapc.worker.worker import runner_adapter

    with pytest.raises(EngineError, match=r"V2 \(vllm/v1/worker/gpu/\) and V1 .* but this engine runs engine_toy.ToyRunner"):
        runner_adapter(ToyRunner(None))



@pytest.mark.parametrize("taps", [["model.layers.*.resid", "model.layers.1.mlp.up_proj.output"],
                                  ["model.layers.2.resid | add(steer, alpha=a, at=prompt)",
                                   "model.layers.0.resid | set([1, 2], 1.5)"]],
                         ids=["captures only", "edits only"])
def test_the_compiled_fill_writes_what_numpys_writes_on_plans_of_one_kind(taps):
    """The compiled fill on a plan without edits and on one without
    captures: the same tables, segments, pool rows used and next positions as numpy's fill,
    step after step (chunked prefill, decode, shuffled batches, untapped requests)."""
    from tapc.worker.fill_jit import CompiledFill

    plan = toy_plan(taps, rows=256)
    layout = Layout(plan)
    keys = [t.key for t in layout.captures]
    rng = np.random.default_rng(7)

    def requests():
        out = {}
        for i in range(7):
            plen, gen = int(rng.integers(1, 20)), int(rng.integers(1, 6))
            ask = TapRequest(capture=keys[: int(rng.integers(1, len(keys) + 1))] if keys else [],
                             positions=["all", "prompt", "generated", "last"][i % 4],
                             params={"steer": rng.standard_normal(HIDDEN), "a": 0.5} if i % 3 and layout.edits else {})
            rec = Record(layout, f"r{i}", WireRequest(f"t{i}", check(plan, ask, f"r{i}")), plen, gen, cpu_alloc)
            rec.slot = i if rec.edits else -1
            out[f"r{i}"] = (rec, plen, plen + gen - 1)
        return out

    state = rng.bit_generator.state
    mine, theirs = requests(), None
    rng.bit_generator.state = state
    theirs = requests()
    compiled, done, steps = CompiledFill(layout), dict.fromkeys(mine, 0), 0
    while any(done[r] < mine[r][2] for r in mine):
        live = [r for r in mine if done[r] < mine[r][2]]
        live = [live[k] for k in rng.permutation(len(live))]
        counts = [min(int(rng.integers(1, 8)), mine[r][2] - done[r]) for r in live]
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        batch = StepBatch(live, qsl, np.array([done[r] for r in live], dtype=np.int32),
                          np.array([mine[r][1] for r in live], dtype=np.int32), int(qsl[-1]) + 3)
        got_table, want_table = np.full((layout.table_rows, 256), 7, np.int32), np.full((layout.table_rows, 256), 7, np.int32)
        got = compiled(got_table, tapped_of({r: v[0] for r, v in mine.items() if r != "r6"}, batch), batch)
        want = fill_step(layout, want_table, tapped_of({r: v[0] for r, v in theirs.items() if r != "r6"}, batch), batch)
        assert got is not None
        assert (got_table[:, :batch.padded] == want_table[:, :batch.padded]).all(), steps
        assert got[1] == want[1]
        # (in any order)
        assert sorted((s.store.group, s.start, s.rows, s.store.caps_key) for s in got[0]) == \
            sorted((s.store.group, s.start, s.rows, s.store.caps_key) for s in want[0])
        assert [mine[r][0].next_pos for r in live] == [theirs[r][0].next_pos for r in live]
        for r, n in zip(live, counts):
            done[r] += n
        steps += 1
    assert steps > 3


@pytest.mark.parametrize("path", ["numpy", "compiled"])
def test_a_rings_fill_leaves_each_block_room_for_its_phases_and_marks_its_rows(path):
    """`fill_step(..., phases)` (a ring's first step, rings.py) lays each capturing
    request's block out as the plain fill does, `phases` times as far apart, and writes each
    captured row's position into the ring row (the capture kernels' phase 0); the plain fill
    leaves the ring row -1. An untapped request between them is left alone. On both fills:
    numpy's (fill.py) and the compiled one (fill_jit.py)."""
    from tapc.worker import fill
    from tapc.worker.fill_jit import CompiledFill

    plan = toy_plan(["model.layers.*.resid", "model.layers.1.mlp.up_proj.output"], rows=256)
    layout = Layout(plan)
    compiled = CompiledFill(layout) if path == "compiled" else None

    def fill_once(phases):
        records = {rid: Record(layout, rid, WireRequest(rid, check(plan, TapRequest(capture="*", positions=pos), rid)),
                               plen, 40, cpu_alloc) for rid, plen, pos in (("a", 4, "all"), ("b", 6, "generated"))}
        owner = {id(st): rid for rid, rec in records.items() for st in rec.stores}
        batch = StepBatch(["a", "plain", "b"], np.arange(4, dtype=np.int32), np.array([9, 5, 12], dtype=np.int32),
                          np.array([4, 3, 6], dtype=np.int32), 8)
        table = np.full((layout.table_rows, 8), 7, np.int32)
        tapped = tapped_of(records, batch)
        segments, used = (compiled and compiled(table, tapped, batch, phases)) or \
            fill.fill_step(layout, table, tapped, batch, phases)
        return table, {(owner[id(seg.store)], seg.store.group): (seg.start, seg.rows) for seg in segments}, used

    plain, ring = fill_once(1), fill_once(PHASES)
    assert plain[0][layout.ring_row].tolist() == [-1] * 8
    assert ring[0][layout.ring_row].tolist() == [9, -1, 12, -1, -1, -1, -1, -1]
    assert ring[2] == [PHASES * u for u in plain[2]] and all(plain[2])
    assert len(plain[1]) == 4 and ring[1] == {k: (PHASES * start, rows) for k, (start, rows) in plain[1].items()}
    for c in range(len(layout.captures)):
        g = layout.cap_group[c]
        for rid, row in (("a", 0), ("b", 2)):   # the same place in a block PHASES times as large
            start = plain[1][rid, g][0]
            assert ring[0][c, row] - PHASES * start == plain[0][c, row] - start >= 0
        assert ring[0][c, 1] == plain[0][c, 1] == -1 and (ring[0][c, 3:] == -1).all()
