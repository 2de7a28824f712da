"""Several GPUs on the CPU: the plan's parallel fields and per-GPU sizes, each GPU's part of
the plan, edits' values mapped to a GPU's columns, and the API merging every worker's
`tapc_collect` reply (real protocol, real arenas in a temporary directory) into single-GPU
results: sharded captures placed with the map against the whole tensor, a request that failed
on one GPU failing as a whole with every other GPU's chunks given back."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from engine_toy import over_the_wire, wire_for

from places import CONFIGS
from tapc.wire.arena import Arena
from tapc.worker.buffers import ParamTables
from tapc.worker.layout import Layout
from tapc.wire.positions import expected_rows
from tapc.wire.protocol import Chunk, CollectReply, Result, StoreResult
from tapc.api.requests import TapRequest
from tapc.lang.edits import check_param
from tapc.errors import PlanError, ProtocolError, ResolveError
from tapc.plan.tapplan import READ, TapPlan
from tapc.plan.planner import build_plan
from tapc.plan.ranks import rank_taps
from tapc.api.session import TapSession
from tapc.plan.sharding import ModelDims, global_columns, shard_points
from tapc.plan.sizing import ITEMSIZE, ROW_ENTRY

LLAMA = str(CONFIGS / "llama")       # 8 heads, 4 kv heads, head_dim 32, 4 layers, hidden 256
ROWS, SEQS = 64, 4
CAPTURES = ["model.layers.*.resid", "model.layers.1.self_attn.qkv_proj.output", "model.layers.2.mlp.act_fn.output",
            "model.layers.0.self_attn.o_proj.input", "model.layers.3.self_attn.source.qkv_split_0.output[1]", "logits"]


def plan_for(taps, tp=1, pp=1):
    return build_plan(LLAMA, taps, max_num_batched_tokens=ROWS, max_num_seqs=SEQS,
                      engine_args={"tensor_parallel_size": tp, "pipeline_parallel_size": pp})


# ----------------------------------------------------------------------------- the plan


def test_plan_records_sizes_layouts_stages_and_round_trips(trees):
    plan = plan_for(CAPTURES, tp=2, pp=2)
    one = plan_for(CAPTURES)
    shards = shard_points(trees("llama"), [t.point for t in one.taps], ModelDims.of_model(LLAMA), tp=2, pp=2)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.pp_layers) == (2, 2, ((0, 2), (2, 4)))
    for tap, single in zip(plan.taps, one.taps):
        assert tap.width == single.width, "widths stay the single-GPU ones"
        assert (tap.layout, tap.stage) == (shards[tap.key].layout, shards[tap.key].stage)
    assert {t.key: t.layout for t in plan.taps}["model.layers.1.self_attn.qkv_proj.output"] == "qkv"
    assert {t.key: t.stage for t in plan.taps}["logits"] == 1
    assert TapPlan.from_json(plan.to_json()) == plan
    assert one.shards == () and one.tensor_parallel_size == 1


def test_each_gpu_is_sized_at_its_local_widths():
    """buffer_bytes: the GPU that allocates most for the tap, from the map's local widths."""
    plan = plan_for(CAPTURES, tp=2, pp=2)
    shards = plan.shard_map
    # each GPU's first capture also holds the rings' row table (its starts)
    firsts = {next(t.key for t in plan.taps if t.kind == READ and t.stage == s and shards[t.key].ranks[r].writes)
              for s in range(2) for r in range(2)}
    for tap in plan.taps:
        if tap.key == "logits":
            assert tap.buffer_bytes == 0   # kept per step, not preallocated
            continue
        local = max(r.local_width for r in shards[tap.key].ranks if r.writes)
        tables = 2 if tap.key in firsts else 1
        # pool, snapshot, decode snapshot; row table(s)
        assert tap.buffer_bytes == (2 * ROWS + SEQS) * local * ITEMSIZE[tap.dtype] + tables * ROWS * ROW_ENTRY
    per_gpu = [sum(t.buffer_bytes for t in plan.taps if t.stage == s and
                   shards[t.key].ranks[r].writes) for s in range(2) for r in range(2)]
    assert plan.total_buffer_bytes == max(per_gpu)
    assert plan.total_buffer_bytes < plan_for(CAPTURES).total_buffer_bytes


def test_what_cannot_run_is_refused_with_the_maps_words():
    with pytest.raises(PlanError, match=r"qkv_proj.output is sharded across 2 GPUs .* project_out needs the whole "
                                        r"row: tap `model.layers.0.self_attn.output` instead"):
        plan_for(["model.layers.0.self_attn.qkv_proj.output | project_out(d)"], tp=2)
    with pytest.raises(PlanError, match="split differently across 2 GPUs: use two names"):
        # both 256 wide, but o_proj's input is split by query heads and the residual is not
        plan_for(["model.layers.0.self_attn.o_proj.input | add(v)", "model.layers.0.resid | add(v)"], tp=2)
    # the same taps run on one GPU, and replicated points take every kind of tap
    plan_for(["model.layers.0.self_attn.qkv_proj.output | project_out(d)", "model.layers.0.mlp.act_fn.output -> f"])
    plan_for(["model.layers.0.resid | project_out(d)", "model.layers.1.mlp.output -> f"], tp=2)



def test_moe_inner_points_and_per_head_norms_are_refused():
    moe = str(CONFIGS / "qwen2_moe")
    with pytest.raises(PlanError, match="inside the mixture-of-experts block"):
        build_plan(moe, ["model.layers.0.mlp.experts.output"], engine_args={"tensor_parallel_size": 2})
    # refused at any size by resolve (a per-head view has no [tokens, width] rows), before the map
    with pytest.raises(ResolveError, match="its caller applies it per head"):
        build_plan(str(CONFIGS / "qwen3"), ["model.layers.0.self_attn.q_norm.output"],
                   engine_args={"tensor_parallel_size": 2})


# ----------------------------------------------------------------------------- each GPU's part


def test_each_gpu_installs_its_stage_and_captures_what_it_writes():
    plan = plan_for(CAPTURES + ["model.layers.*.resid | add(v)", "model.layers.2.mlp.act_fn.output | zero([0, 400])"],
                    tp=2, pp=2)
    shards = plan.shard_map
    for stage in range(2):
        for r in range(2):
            mine = rank_taps(plan.taps, shards, r, stage)
            layers = {t.layer for t in mine if t.layer is not None}
            assert layers <= set(range(*plan.pp_layers[stage]))
            caps = {t.key: t.width for t in mine if t.action == "capture"}
            resid = {f"model.layers.{i}.resid" for i in range(*plan.pp_layers[stage])}
            written = {f"model.layers.{i}.resid" for i in range(*plan.pp_layers[stage]) if i % 2 == r}
            assert resid & set(caps) == written, "replicated: each layer's captured by rank layer % 2 only"
            edits = {t.key for t in mine if t.action == "add"}
            assert edits == resid, "edits on replicated points run on every rank"
            for t in mine:
                if shards[t.key].sharded:
                    assert t.width == shards[t.key].ranks[r].local_width
            zero = [t for t in mine if t.action == "zero"]
            if stage == 1:   # 704 columns of act_fn: 0 on rank 0, 400 on rank 1 -> local 400 - 352
                (z,) = zero
                assert z.args[0].value == ((0,) if r == 0 else (48,))
            assert ("logits" in caps) == (stage == 1 and r == 0)


def test_request_values_are_written_as_each_gpus_columns():
    """ParamTables on the CPU: a request's vector and columns land in a GPU's slot as its part."""
    plan = plan_for(["model.layers.0.mlp.act_fn.output | add(v)", "model.layers.0.mlp.down_proj.input | set(c, 2.0)",
                     "model.layers.1.self_attn.qkv_proj.output | set(k, w)",
                     "model.layers.1.mlp.act_fn.output | patch(p, rows=3)"], tp=2)
    shards = plan.shard_map
    rng = np.random.default_rng(0)
    v = rng.standard_normal(704).astype(np.float32)
    rows = rng.standard_normal((2, 704)).astype(np.float32)
    cols, qkv_cols, w = [3, 400, 703], [5, 300, 500], [1.0, 2.0, 3.0]   # qkv: q 0..255, k 256..383, v 384..511
    for r in range(2):
        layout = Layout(plan, r, 0)
        tables = ParamTables(layout.edits, 4, torch.device("cpu"), layout.localize)
        tables.write(1, [0, 1, 2, 3], {"v": v.tobytes(), "c": cols, "k": qkv_cols, "w": w,
                                       "p": check_param("rows", {"positions": [7, 2], "rows": rows}, 704)})
        act = shards["model.layers.0.mlp.act_fn.output"]
        np.testing.assert_array_equal(tables.tables[0]["vector"][1].numpy(), v[global_columns(act, r)])
        # patch rows: each row's columns of this GPU, their positions as they are, the rest empty
        g = global_columns(shards["model.layers.1.mlp.act_fn.output"], r)
        np.testing.assert_array_equal(tables.tables[3]["src"][1].numpy(), np.vstack([rows[:, g], np.zeros((1, len(g)))]))
        assert tables.tables[3]["src_at"][1].tolist() == [7, 2, -1]
        for e, key, want, vals in ((1, "model.layers.0.mlp.down_proj.input", cols, None),
                                   (2, "model.layers.1.self_attn.qkv_proj.output", qkv_cols, w)):
            g = global_columns(shards[key], r)
            got = tables.tables[e]["cols"][1].numpy()
            local = [int(c) for c in got if c >= 0]
            assert sorted(g[local]) == sorted(c for c in want if c in set(g))
            if vals is not None:
                value = tables.tables[e]["value"][1].numpy()[:len(local)]
                assert list(value) == [vals[want.index(int(g[c]))] for c in local]


# ----------------------------------------------------------------------------- the API merges


@pytest.fixture
def arenas(tmp_path):
    """`arenas(n)`: n workers' arenas of small segments, removed after the test (a worker's
    default segment is a GiB of disk each)."""
    made = []

    def make(n):
        made.extend(Arena(directory=str(tmp_path), segment_bytes=1 << 20) for _ in range(n))
        return made[-n:]
    yield make
    for arena in made:
        arena.close()


def _reply(arenas, plan, tid, whole, tp, error_on=None):
    """Each worker's collect reply for one request, as the worker builds it (rank_taps' captures,
    local columns of `whole[key]` in the worker's own arena), over the wire."""
    replies = []
    for g, arena in enumerate(arenas):
        stage, r = divmod(g, tp)
        if g == error_on:
            replies.append(over_the_wire(CollectReply((Result(tid, error="no room for its captures"),)).to_wire()))
            continue
        stores = []
        for tap in rank_taps(plan.taps, plan.shard_map, r, stage):
            if tap.action != "capture" or tap.key == "logits":
                continue
            full = whole[tap.key]
            part = full[:, global_columns(plan.shard_map[tap.key], r)]
            t = arena.tensor(part.shape[0], 1, part.shape[1], torch.float32)
            t[:, 0] = part
            stores.append(StoreResult((tap.key,), "float32", part.shape[1], part.shape[0],
                                      (Chunk(*arena.locate(t), part.shape[0], part.shape[0]),), rank=r))
        replies.append(over_the_wire(CollectReply((Result(tid, stores=tuple(stores)),)).to_wire()))
    return replies


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2), (4, 1), (1, 2)])
def test_session_merges_every_gpus_reply_into_single_gpu_tensors(arenas, tp, pp):
    taps = [t for t in CAPTURES if t != "logits"]
    plan = build_plan(LLAMA, taps, max_num_batched_tokens=ROWS, max_num_seqs=SEQS, capture_dtype="float32",
                      engine_args={"tensor_parallel_size": tp, "pipeline_parallel_size": pp})
    session = TapSession(plan)
    wire = wire_for(plan, TapRequest(capture=list(plan.capture_keys)), "t1")
    out = NS(request_id="r1", prompt_token_ids=list(range(5)), outputs=[NS(token_ids=[1, 2, 3])])
    rows = expected_rows("all", 5, 3)
    gen = torch.Generator().manual_seed(tp * 10 + pp)
    whole = {t.key: torch.randn(rows, t.width, generator=gen) for t in plan.taps}
    got = session.results(_reply(arenas(tp * pp), plan, "t1", whole, tp))
    session.finish(out, wire, got["t1"])
    assert out.error is None and set(out.taps) == set(whole)
    for key, t in whole.items():
        torch.testing.assert_close(out.taps[key], t, rtol=0, atol=0)
    sharded = {k for k in whole if plan.shard_map[k].sharded}
    assert bool(sharded) == (tp > 1)


def test_a_request_failed_on_one_gpu_fails_whole_and_the_others_chunks_go_back(arenas):
    plan = build_plan(LLAMA, CAPTURES[:3], max_num_batched_tokens=ROWS, max_num_seqs=SEQS, capture_dtype="float32",
                      engine_args={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    session = TapSession(plan)
    wire = wire_for(plan, TapRequest(capture=list(plan.capture_keys)), "t1")
    whole = {t.key: torch.randn(6, t.width) for t in plan.taps}
    workers = arenas(4)
    replies = _reply(workers, plan, "t1", whole, 2, error_on=3)
    held = [(c.path, c.offset) for w in replies for r in CollectReply.from_wire(w).results for s in r.stores
            for c in s.chunks]
    assert held, "the other GPUs hold chunks for the request"
    got = session.results(replies)
    out = NS(request_id="r1", prompt_token_ids=list(range(4)), outputs=[NS(token_ids=[1, 2, 3])])
    session.finish(out, wire, got["t1"])
    assert "GPU 3 (pipeline stage 1, tensor-parallel rank 1): no room for its captures" in str(out.error)
    with pytest.raises(KeyError, match="this request's taps failed"):
        out.taps["model.layers.0.resid"]
    released = session.released()
    assert sorted(released) == sorted(held)
    # every worker gets the same list and gives back its own files' chunks only
    for arena in workers:
        mine = [(p, o) for p, o in released if arena.owns(p)]
        for p, o in mine:
            arena.give_back(p, o)
        assert not arena.held


def test_a_missing_rank_is_an_error_not_a_short_tensor(arenas):
    plan = build_plan(LLAMA, ["model.layers.2.mlp.act_fn.output"], max_num_batched_tokens=ROWS, max_num_seqs=SEQS,
                      capture_dtype="float32", engine_args={"tensor_parallel_size": 2})
    session = TapSession(plan)
    wire = wire_for(plan, TapRequest(capture=list(plan.capture_keys)), "t1")
    whole = {t.key: torch.randn(6, t.width) for t in plan.taps}
    replies = _reply(arenas(2), plan, "t1", whole, 2)
    one = CollectReply.from_wire(replies[1]).results[0]
    replies[1] = CollectReply((Result("t1", stores=(dataclasses.replace(one.stores[0], rank=0),)),)).to_wire()
    out = NS(request_id="r1", prompt_token_ids=list(range(4)), outputs=[NS(token_ids=[1, 2, 3])])
    session.finish(out, wire, session.results(replies)["t1"])
    assert "lack the columns of tensor-parallel rank(s) [1]" in str(out.error)
    with pytest.raises(ProtocolError, match="1 tapc_collect replies for engines of 2 GPUs each"):
        session.results(replies[0])


def test_explain_shows_layout_stage_and_bytes_per_gpu(capsys, monkeypatch):
    from tapc.cli import main

    monkeypatch.setenv("COLUMNS", "400")   # a wide terminal: each row on one line

    assert main(["explain", LLAMA, "model.layers.*.resid", "model.layers.1.mlp.act_fn.output",
                 "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--max-num-batched-tokens",
                 str(ROWS), "--max-num-seqs", str(SEQS)]) == 0
    text = capsys.readouterr().out
    plan = plan_for(["model.layers.*.resid", "model.layers.1.mlp.act_fn.output"], tp=2, pp=2)
    from tapc.plan.explain import human_bytes

    for tap in plan.taps:
        row = next(line for line in text.splitlines() if line.startswith(f"│ {tap.key} "))
        assert f"{tap.layout}, stage {tap.stage}" in row and human_bytes(tap.buffer_bytes) in row
    assert "columns, stage 0" in text and "stages hold decoder layers 0..1, 2..3" in text
    assert f"{human_bytes(plan.total_buffer_bytes)} on the most loaded GPU" in text
    # host bytes a token: stage 0's rank 1 writes layer 1's residual stream (replicated points go
    # to rank layer % 2) and its half of layer 1's act_fn output; every other GPU one residual row
    config = json.loads((Path(LLAMA) / "config.json").read_text())
    most = 2 * config["hidden_size"] + 2 * config["intermediate_size"] // 2
    assert f"captures in host memory: up to {human_bytes(most)} a token on the most loaded GPU" in text


# ----------------------------------------------------------------------------- two stages, end to end


def test_two_pipeline_stages_through_the_workers_hooks_equal_one_gpu():
    """The toy engine as two pipeline stages: each stage's worker hooks (install, tables, records,
    arena, collect) on its own copy of the model with its part of the plan, the same requests
    scheduled on both, replies merged by the API: equal to one GPU's run of the same taps. The
    toy model cannot hand hidden states between stages, so each copy runs every layer; the edit
    sits on the last stage, so what stage 1 computes before it is what stage 0 would send."""
    from engine_toy import HIDDEN, INTER, Req, ToyModel, hooks_for, output_of, run, toy_tree

    # the edit changes layer 2's residual stream, which is captured after it
    taps = ["model.layers.*.resid", "model.layers.*.mlp.up_proj.output",
            "model.layers.2.mlp.up_proj.output | add(steer, alpha=2.0)"]

    def plan(pp):
        return build_plan("toy", taps, max_num_batched_tokens=64, max_num_seqs=8, tree=toy_tree(),
                          engine_args={"pipeline_parallel_size": pp}, dims=ModelDims(1, 1, HIDDEN))

    one, two = plan(1), plan(2)
    assert two.pp_layers == ((0, 2), (2, 3))
    assert [len(Layout(two, 0, stage).edits) for stage in (0, 1)] == [0, 1]
    assert [len(Layout(two, 0, stage).captures) for stage in (0, 1)] == [4, 2]
    steer = np.random.default_rng(5).standard_normal(INTER).tolist()
    asks = [TapRequest(capture=list(one.capture_keys), params={"steer": steer}), TapRequest(capture="model.layers.2.resid"),
            TapRequest(capture="model.layers.0.resid", positions="generated")]
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]

    def reqs(p):
        return [Req(f"r{i}", pr, 4, wire_for(p, a, f"t{i}"), arrive=i) for i, (pr, a) in enumerate(zip(prompts, asks))]

    def outputs(p, stages):
        session = TapSession(p)
        replies, done = [], None
        for stage in range(stages):
            runner, hooks = hooks_for(p, ToyModel(), stage=stage)
            done = reqs(p)
            run(runner, done, budget=8)
            replies.append(over_the_wire(hooks.collect([r.wire.id for r in done]).to_wire()))
        got = session.results(replies if stages > 1 else replies[0])
        outs = []
        for r in done:
            outs.append(output_of(r))
            session.finish(outs[-1], r.wire, got[r.wire.id])
        return outs

    ref, got = outputs(one, 1), outputs(two, 2)
    assert [len(r.taps) for r in ref] == [len(one.capture_keys), 1, 1]
    for r, g in zip(ref, got):
        assert r.error is None and g.error is None and set(g.taps) == set(r.taps)
        for key in r.taps:
            torch.testing.assert_close(g.taps[key], r.taps[key], rtol=0, atol=0)
