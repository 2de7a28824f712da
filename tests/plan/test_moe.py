"""Mixture-of-experts models without a GPU: vLLM's trees of Qwen3-MoE and Mixtral on meta (the
router as a tap point, what runs inside the fused-MoE op), the plan and its refusals, `tapc
explain`; and the engine end to end on a toy MoE (tests/support/engine_toy.py's runners, V2 and V1):
router logits, the chosen experts and their weights, the MoE block's output, and a per-request
router edit that bans an expert, each against the toy model run alone with the same edit."""
import types

import numpy as np
import pytest
import torch
from places import CONFIGS
from engine_toy import HIDDEN, VOCAB, Linear, Req, ToyModel, collect, hooks_for, run, toy_tree, wire_for

from tapc.api.requests import TapRequest
from tapc.errors import ResolveError
from tapc.plan.planner import build_plan
from tapc.api.session import TapSession
from tapc.plan.tree import Node

EXPERTS, TOP_K, LAYERS = 6, 2, 2


# ----------------------------------------------------------------------------- vLLM's trees


@pytest.mark.parametrize("arch,moe,gate_in_op", [("qwen3_moe", "mlp", True), ("mixtral", "block_sparse_moe", False)])
def test_moe_trees_have_the_router_and_say_what_runs_in_the_fused_op(trees, arch, moe, gate_in_op):
    tree = trees(arch)
    nodes = tree.by_path
    router = nodes[f"model.layers.1.{moe}.experts.router"]
    assert (router.output, router.out_width, router.in_moe_op, router.layer) == ("routing", 2, True, 1)
    # Qwen3-MoE's layer holds the gate but vLLM calls it inside the op (the runner holds it too);
    # Mixtral calls it in its own forward, in the compiled graph.
    assert nodes[f"model.layers.0.{moe}.gate"].in_moe_op is gate_in_op
    assert nodes[f"model.layers.0.{moe}"].in_moe_op is False and nodes[f"model.layers.0.{moe}.experts"].in_moe_op is False
    # The routed experts run through `forward_modular`, never `forward`: nothing to tap there.
    assert nodes[f"model.layers.0.{moe}.experts.routed_experts"].output == "none"


def test_qwen2_moe_shared_expert_runs_in_the_op_and_its_wrapper_is_not_tappable(trees):
    nodes = trees("qwen2_moe").by_path
    assert nodes["model.layers.0.mlp.shared_expert"].in_moe_op and nodes["model.layers.0.mlp.shared_expert"].output == "tensor"
    assert nodes["model.layers.0.mlp.experts._shared_experts"].output == "none"
    assert not nodes["model.layers.0.mlp.gate"].in_moe_op


def plan(arch: str, taps, **kw):
    return build_plan(str(CONFIGS / arch), taps, **kw)


@pytest.mark.parametrize("arch,moe", [("qwen3_moe", "mlp"), ("mixtral", "block_sparse_moe")])
def test_moe_plan_router_logits_choice_and_block_output(arch, moe):
    p = plan(arch, [f"model.layers.*.{moe}.gate.output", f"model.layers.*.{moe}.experts.router.output",
                    f"model.layers.1.{moe}.output", f"model.layers.0.{moe}.gate.output | set(ban, -10000.0)"])
    got = {t.key: (t.width, t.dtype) for t in p.taps if t.kind == "read"}
    for i in range(2):
        assert got[f"model.layers.{i}.{moe}.gate.output"] == (8, "bfloat16")
        assert got[f"model.layers.{i}.{moe}.experts.router.output[0]"] == (2, "float32")
        assert got[f"model.layers.{i}.{moe}.experts.router.output[1]"] == (2, "int32")
    assert got[f"model.layers.1.{moe}.output"] == (128, "bfloat16")
    assert [(t.key, t.action) for t in p.taps if t.kind == "edit"] == [(f"model.layers.0.{moe}.gate.output", "set")]


@pytest.mark.parametrize("tap,words", [
    ("model.layers.0.mlp.experts.router.output | add(v)", r"edit those instead: `model.layers.0.mlp.gate.output \| set\(\[e\], -1e4\)` bans"),
    ("model.layers.0.mlp.experts.router.output[2]", r"`.output\[0\]` the weights, `.output\[1\]` the expert ids"),
    ("model.layers.0.mlp.experts.router.input", "not an activation tapc can read"),
    ("model.layers.0.mlp.gate.output -> probe", r"inside vLLM's fused-MoE op \(vllm::moe_forward\).*cannot be split"),
    ("model.layers.0.mlp.experts.router.output -> probe", "inside vLLM's fused-MoE op"),
    ("model.layers.0.mlp.experts.routed_experts.output", "vLLM does not call in the forward"),
])
def test_moe_refusals_name_what_works(tap, words):
    with pytest.raises(ResolveError, match=words):
        plan("qwen3_moe", [tap])


def test_a_block_at_mixtrals_gate_is_planned_it_runs_in_the_graph():
    p = plan("mixtral", ["model.layers.0.block_sparse_moe.gate.output -> probe"])
    assert [t.kind for t in p.taps] == ["block"]


def test_explain_lists_the_router_and_marks_the_fused_op(trees):
    from tapc.plan.explain import render_points

    text = render_points(trees("qwen3_moe"), width=400)
    row = next(line for line in text.splitlines() if "mlp.experts.router " in line)
    assert "FusedTopKRouter" in row and "expert ids (int32)" in row and "no Python blocks" in row
    gate = next(line for line in text.splitlines() if "model.layers.*.mlp.gate " in line)
    assert "inside the fused-MoE op" in gate


# ----------------------------------------------------------------------------- a toy MoE engine


class Router:
    """Like vLLM's routers: a plain object; softmax top-k, renormalized, float32 weights, int32 ids."""

    top_k = TOP_K

    def select_experts(self, hidden_states, router_logits, topk_indices_dtype=None):
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, ids = probs.topk(TOP_K, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


class Runner(torch.nn.Module):
    """Plays vLLM's MoE runner: holds the router and the experts, combines their outputs."""

    def __init__(self):
        super().__init__()
        self.router = Router()
        self.w = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) / HIDDEN ** 0.5)

    def forward(self, hidden_states, router_logits):
        weights, ids = self.router.select_experts(hidden_states, router_logits)
        outs = torch.einsum("th,teoh->teo", hidden_states, self.w[ids.long()])
        return (weights[..., None] * outs).sum(1)


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Linear(HIDDEN, EXPERTS)
        self.experts = Runner()

    def forward(self, x):
        logits, _ = self.gate(x)
        return self.experts(x, logits)


def toy_moe() -> ToyModel:
    """engine_toy's decoder stack with an MoE for its MLP."""
    return ToyModel(seed=3, mlp=MoE, layers=LAYERS)


def moe_nodes(p: str, i: int) -> list[Node]:
    return [Node(p, "MoE", "tensor", HIDDEN, HIDDEN, layer=i),
            Node(f"{p}.gate", "ReplicatedLinear", "linear", HIDDEN, EXPERTS, layer=i),
            Node(f"{p}.experts", "MoERunner", "tensor", HIDDEN, HIDDEN, layer=i),
            Node(f"{p}.experts.router", "Router", "routing", None, TOP_K, layer=i, in_moe_op=True)]


TAPS = ["model.layers.*.mlp.gate.output | add(ban, alpha=1.0)", "model.layers.*.mlp.gate.output",
        "model.layers.*.mlp.experts.router.output", "model.layers.*.mlp.output", "model.layers.*.resid"]


def reference(req: Req, ban: np.ndarray | None, make=toy_moe) -> dict[str, torch.Tensor]:
    """The toy (`make()`) alone on the request's tokens, `ban` added to every layer's router logits."""
    model = make()
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def gate_hook(m, a, out, i=i):
            logits = out[0] if ban is None else out[0] + torch.as_tensor(ban, dtype=out[0].dtype)
            seen[f"model.layers.{i}.mlp.gate.output"] = logits.detach().clone()
            return logits, None

        def router(hidden_states, router_logits, i=i, select=layer.mlp.experts.router.select_experts):
            w, ids = select(hidden_states, router_logits)
            seen[f"model.layers.{i}.mlp.experts.router.output[0]"] = w.detach().clone()
            seen[f"model.layers.{i}.mlp.experts.router.output[1]"] = ids.clone()
            return w, ids

        layer.mlp.experts.router.select_experts = router
        handles.append(layer.mlp.gate.register_forward_hook(gate_hook))
        handles.append(layer.mlp.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(f"model.layers.{i}.mlp.output", out.detach().clone())))
        handles.append(layer.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(f"model.layers.{i}.resid", (out[0] + out[1]).detach().clone())))
    toks = req.tokens[:-1]
    with torch.no_grad():
        model(torch.tensor(toks), torch.arange(len(toks)))
    return seen


@pytest.mark.parametrize("runner_kind", ["v2", "v1"])
def test_toy_moe_router_captures_and_a_per_request_expert_ban(runner_kind):
    """Three requests in one continuously batched run (chunked prefill, a late arrival): one bans
    expert 2 through its router logits, one bans expert 4, one edits nothing. Each request's
    gate logits, chosen experts and weights, MoE output and residual stream equal the toy run
    alone with its own ban, and a banned expert is never chosen for that request."""
    plan = build_plan("toy", TAPS, max_num_batched_tokens=64, max_num_seqs=8,
                      tree=toy_tree(moe_nodes, LAYERS, "ToyMoeForCausalLM"))
    runner, hooks = hooks_for(plan, toy_moe(), runner=runner_kind)
    rng = np.random.default_rng(4)
    bans = {"b2": 2, "b4": 4, "plain": None}
    vectors = {}
    reqs = []
    for k, (rid, expert) in enumerate(bans.items()):
        params = {}
        if expert is not None:
            vectors[rid] = np.zeros(EXPERTS, dtype=np.float32)
            vectors[rid][expert] = -1e4
            params = {"ban": vectors[rid]}
        wire = wire_for(plan, TapRequest(capture="*", params=params), rid)
        reqs.append(Req(rid, rng.integers(0, VOCAB, 7 + 9 * k).tolist(), 5, wire, arrive=k))
    run(runner, reqs, budget=16)
    outs = collect(hooks, reqs, TapSession(plan))
    for r in reqs:
        taps = dict(outs[r.rid].taps)
        ref = reference(r, vectors.get(r.rid))
        assert set(taps) == set(ref)
        for key, value in taps.items():
            if key.endswith("router.output[1]"):
                assert value.dtype == torch.int32, key
                assert torch.equal(value, ref[key]), f"{r.rid} {key}: expert ids differ"
            else:
                torch.testing.assert_close(value, ref[key], rtol=1e-5, atol=1e-4, msg=lambda m: f"{r.rid} {key}: {m}")
        ids = torch.cat([taps[f"model.layers.{i}.mlp.experts.router.output[1]"] for i in range(LAYERS)])
        if bans[r.rid] is not None:
            assert not (ids == bans[r.rid]).any(), f"{r.rid} chose its banned expert"
    plain = torch.cat([dict(outs["plain"].taps)[f"model.layers.{i}.mlp.experts.router.output[1]"] for i in range(LAYERS)])
    assert (plain == 2).any() and (plain == 4).any(), "the unedited request uses both experts (the bans changed something)"


class GatedRunner(Runner):
    """vLLM 0.26's runner that holds its gate and calls it inside the op, right before its router
    (`_forward_impl`), with no rows dispatched between them."""

    _fse_fuse_gate = False
    do_naive_dispatch_combine = False

    def __init__(self, gate, dispatch: bool = False):
        super().__init__()
        self.gate = gate
        self.moe_config = types.SimpleNamespace(pcp_size=2 if dispatch else 1)

    def forward(self, hidden_states, router_logits):
        router_logits, _ = self.gate(hidden_states)
        return super().forward(hidden_states, router_logits)


class GatedMoE(MoE):
    """Qwen3-MoE's block in vLLM 0.26: the gate under `mlp.gate` and `mlp.experts.gate`."""

    dispatch = False

    def __init__(self):
        super().__init__()
        self.experts = GatedRunner(self.gate, self.dispatch)

    def forward(self, x):
        return self.experts(x, x)


class DispatchingMoE(GatedMoE):
    dispatch = True   # context parallel: the router would see other ranks' rows too


@pytest.mark.parametrize("moe,taps,trio", [
    (GatedMoE, ["model.layers.*.mlp.gate.output", "model.layers.*.mlp.experts.router.output", "model.layers.*.resid"],
     True),
    (GatedMoE, TAPS, False),   # an edit at the gate: its capture stays in the gate's forward, before the edit
    (DispatchingMoE, TAPS[1:3], False),
    (MoE, TAPS[1:3], False),   # the gate outside the runner (Mixtral): the model might change the logits between
], ids=["gate-in-runner", "edit-at-gate", "dispatch", "gate-outside"])
def test_a_gates_logits_join_its_routers_launch_where_the_router_gets_them_as_they_are(moe, taps, trio):
    """install.py `_logits_at_routers`: where the runner calls its gate right before its router,
    the gate's logits capture moves to the router's call, one `capture_trio` launch a layer with
    the weights and ids (the gate's forward unpatched); elsewhere the gate keeps its own launch.
    Captures equal the toy run alone either way (with its ban where the plan has one)."""
    from tapc.kernels import ops

    def make():
        return ToyModel(seed=3, mlp=moe, layers=LAYERS)

    plan = build_plan("toy", taps, max_num_batched_tokens=64, max_num_seqs=8,
                      tree=toy_tree(moe_nodes, LAYERS, "ToyMoeForCausalLM"))
    model = make()
    runner, hooks = hooks_for(plan, model)
    gates = [layer.mlp.gate for layer in model.model.layers]
    assert all(("forward" in g.__dict__) != trio for g in gates), "the gate's forward is patched iff it keeps its capture"
    ban = np.zeros(EXPERTS, dtype=np.float32)
    ban[3] = -1e4
    params = {"ban": ban} if any("add(ban" in t for t in taps) else {}
    rng = np.random.default_rng(5)
    reqs = [Req(f"r{k}", rng.integers(0, VOCAB, 6 + 7 * k).tolist(), 4,
                wire_for(plan, TapRequest(capture="*", params=params), f"r{k}"), arrive=k) for k in range(2)]
    launches = []
    ops.set_launch_observer(lambda tables: launches.append(len(tables)))
    try:
        run(runner, reqs, budget=16)
    finally:
        ops.set_launch_observer(None)
    assert (3 in launches) == trio and (2 in launches) != trio, launches
    outs = collect(hooks, reqs, TapSession(plan))
    for r in reqs:
        got = dict(outs[r.rid].taps)
        ref = reference(r, ban if params else None, make)
        for key, value in got.items():
            if key.endswith("router.output[1]"):
                assert torch.equal(value, ref[key]), f"{r.rid} {key}: expert ids differ"
            else:
                torch.testing.assert_close(value, ref[key], rtol=1e-5, atol=1e-4, msg=lambda m: f"{r.rid} {key}: {m}")
        assert any(k.endswith("gate.output") for k in got) and any(k.endswith("router.output[0]") for k in got)


def test_a_monolithic_expert_kernel_refuses_the_routing_tap_at_install():
    """Kernels that route inside themselves never call `select_experts`: a routing capture
    would stay empty, so the engine refuses it when it installs (the gate's logits still work)."""
    from types import SimpleNamespace as NS

    from tapc.worker.install import install
    from tapc.worker.layout import Layout
    from tapc.errors import EngineError
    from engine_toy import toy_buffers

    tree = toy_tree(moe_nodes, LAYERS, "ToyMoeForCausalLM")
    model = toy_moe()
    for layer in model.model.layers:
        layer.mlp.experts.routed_experts = NS(quant_method=NS(is_monolithic=True))
    ok = build_plan("toy", ["model.layers.0.mlp.gate.output"], max_num_batched_tokens=64, max_num_seqs=8, tree=tree)
    install(model, Layout(ok), toy_buffers(Layout(ok), 64, 8))
    routing = build_plan("toy", ["model.layers.1.mlp.experts.router.output"], max_num_batched_tokens=64,
                         max_num_seqs=8, tree=tree)
    with pytest.raises(EngineError, match="monolithic: it routes inside itself .* tap the gate's logits"):
        install(model, Layout(routing), toy_buffers(Layout(routing), 64, 8))


def test_one_module_under_two_paths_gets_the_taps_of_both():
    """Qwen3-MoE's layer holds its gate as `mlp.gate` and, through the MoE runner, as
    `mlp.experts.gate`: taps under both names land on the one module, in plan order."""
    tree = toy_tree(lambda p, i: [*moe_nodes(p, i), Node(f"{p}.experts.gate", "ReplicatedLinear", "linear", HIDDEN,
                                                         EXPERTS, layer=i)], LAYERS, "ToyMoeForCausalLM")
    model = toy_moe()
    for layer in model.model.layers:
        layer.mlp.experts.gate = layer.mlp.gate
    plan = build_plan("toy", ["model.layers.0.mlp.experts.gate.output | add(ban, alpha=1.0)",
                              "model.layers.0.mlp.gate.output"], max_num_batched_tokens=64, max_num_seqs=8, tree=tree)
    runner, hooks = hooks_for(plan, model)
    ban = np.zeros(EXPERTS, dtype=np.float32)
    ban[1] = -1e4
    rng = np.random.default_rng(9)
    reqs = [Req("r", rng.integers(0, VOCAB, 11).tolist(), 3, wire_for(plan, TapRequest(capture="*", params={"ban": ban}), "r"))]
    run(runner, reqs, budget=64)
    got = dict(collect(hooks, reqs, TapSession(plan))["r"].taps)["model.layers.0.mlp.gate.output"]
    ref = reference(reqs[0], ban)["model.layers.0.mlp.gate.output"]   # the edit ran first: the capture sees it
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


def test_explain_notes_say_what_a_routers_output_is(trees):
    from tapc.plan.resolve import notes

    tree = trees("qwen3_moe")
    p = build_plan(str(CONFIGS / "qwen3_moe"), ["model.layers.*.mlp.experts.router.output", "model.layers.*.output"],
                   tree=tree)
    said = notes(p, tree)
    router = [n for n in said if n.startswith("`model.layers.*.mlp.experts.router.output`")]
    layer = [n for n in said if n.startswith("`model.layers.*.output`")]
    assert len(router) == 1 and "(topk_weights, topk_ids)" in router[0] and "decoder layer" not in router[0]
    assert len(layer) == 1 and "(hidden_states, residual)" in layer[0]


def test_neighbouring_captures_of_a_tuples_elements_run_as_one_launch():
    """install.py `_paired`: the router's weight and id captures (two elements of its output)
    become one `capture_pair` launch; an edit between two captures, a module's plain output or a
    third capture stay as they are; elements with rows of their own fall back to two launches."""
    import tapc.kernels  # noqa: F401  (registers torch.ops.tapc, as install() does)
    from tapc.worker.install import _Capture, _Pair, _paired
    from tapc.plan.tapplan import Point

    module = torch.nn.Module()
    for name, t in {"d0": torch.tensor([1, -1, 0], dtype=torch.int32), "d1": torch.tensor([0, 1, -1], dtype=torch.int32),
                    "p0": torch.zeros(2, 4), "p1": torch.zeros(2, 4, dtype=torch.int32)}.items():
        module.register_buffer(name, t, persistent=False)
    weights, ids = _Capture(module, "d0", "p0"), _Capture(module, "d1", "p1")
    edit = lambda x, b: None  # noqa: E731
    el = [Point("m", "output", element=k) for k in range(3)]
    got = _paired([(el[0], weights), (el[1], ids), (el[2], _Capture(module, "d0", "p0"))])
    assert [type(op) for _, op in got] == [_Pair, _Capture] and got[0][0] == el[0]
    assert [type(op) for _, op in _paired([(el[0], weights), (el[1], edit), (el[2], ids)])] == [_Capture, type(edit), _Capture]
    assert [type(op) for _, op in _paired([(Point("m", "output"), weights), (el[1], ids)])] == [_Capture, _Capture]
    # one pool for both (a norm's output[0] and output[1]): two launches, never one writing it twice
    assert [type(op) for _, op in _paired([(el[0], weights), (el[1], _Capture(module, "d1", "p0"))])] == [_Capture, _Capture]

    w = torch.rand(3, 4)
    i = torch.randint(0, 9, (3, 4), dtype=torch.int32)
    got[0][1].run((w, i))
    assert torch.equal(module.p0[1], w[0]) and torch.equal(module.p0[0], w[2])
    assert torch.equal(module.p1[0], i[0]) and torch.equal(module.p1[1], i[1])
    module.p0.zero_()
    got[0][1].run((w, i[:2]))   # rows of its own: two launches, the same effect
    assert torch.equal(module.p0[1], w[0]) and torch.equal(module.p1[0], i[0])
