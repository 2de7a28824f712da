"""tapc.plan.sharding against fake shards: per-rank weights sliced the way vLLM 0.26's weight
loaders slice them, a decoder layer run rank by rank the way vLLM's sharded layers run it
(local heads, GQA on local kv heads, row-parallel partial sums added as the all-reduce), each
rank's local tensors placed with the map's runs, compared with the single-GPU layer."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tapc.errors import PlanError
from tapc.plan.tapplan import Point
from tapc.plan.shards import REFUSED, REPLICATED
from tapc.plan.sharding import ModelDims, gather_index, global_columns, local_columns, \
    local_vector, parse_key, pp_stages, shard_points
from tapc.plan.tree import ModuleTree, Node, SourceOp, load_tree

from places import CONFIGS

# An odd shape: 6 heads, 3 kv heads, head_dim 16; kv == tp at 3, kv < tp at 6; 5 layers.
ODD = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96, "intermediate_size": 240,
       "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16, "num_hidden_layers": 5,
       "vocab_size": 320, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
       "torch_dtype": "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False}
# More head shapes on a one-layer tree written here like vLLM's Llama tree (the real trees above
# hold the same nodes): MQA, 2 kv heads on 4 ranks, 4 kv heads per rank, 16 ranks.
SHAPES = {"mqa": (8, 1, 16), "kv2": (12, 2, 8), "kv8": (16, 8, 8), "wide": (32, 8, 4)}  # heads, kv, head_dim
CASES = [("llama", 2), ("llama", 4), ("llama", 8), ("qwen3", 2), ("qwen3", 4), ("odd", 3), ("odd", 6),
         ("mqa", 2), ("mqa", 4), ("kv2", 4), ("kv8", 2), ("kv8", 8), ("wide", 16)]
LAYER = "model.layers.0"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (tree, config dict, dims)."""
    odd = tmp_path_factory.mktemp("odd")
    (odd / "config.json").write_text(json.dumps(ODD))
    out = {}
    for name, path in (("llama", CONFIGS / "llama"), ("qwen3", CONFIGS / "qwen3"), ("odd", odd)):
        config = json.loads((path / "config.json").read_text())
        out[name] = (load_tree(str(path)), config, ModelDims.from_config(config))
    for name, (heads, kv, hd) in SHAPES.items():
        config = {**ODD, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
                  "hidden_size": 64, "intermediate_size": 16 * 12, "num_hidden_layers": 1}
        out[name] = (_llama_tree(config), config, ModelDims.from_config(config))
    return out


def _llama_tree(c: dict) -> ModuleTree:
    """Layer 0 of vLLM's Llama tree (as `tapc.plan.tree` records it) for the config `c`."""
    H, I, q, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"] * c["head_dim"], \
        c["num_key_value_heads"] * c["head_dim"]
    split = SourceOp("qkv_split_0", "qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)", 1, (q, kv, kv),
                     q + 2 * kv)

    def node(path, cls, output, w_in, w_out, ops=()):
        return Node(f"{LAYER}{path}", cls, output, w_in, w_out, layer=0, source_ops=ops)

    nodes = (Node("model", "LlamaModel", "tensor", H, H), Node("model.layers", "ModuleList", "none", None, None),
             node("", "LlamaDecoderLayer", "pair", H, H),
             node(".self_attn", "LlamaAttention", "tensor", H, H, (split,)),
             node(".self_attn.qkv_proj", "QKVParallelLinear", "linear", H, q + 2 * kv),
             node(".self_attn.attn", "Attention", "tensor", q, q),
             node(".self_attn.o_proj", "RowParallelLinear", "linear", q, H), node(".mlp", "LlamaMLP", "tensor", H, H),
             node(".mlp.gate_up_proj", "MergedColumnParallelLinear", "linear", H, 2 * I),
             node(".mlp.act_fn", "SiluAndMul", "tensor", 2 * I, I),
             node(".mlp.down_proj", "RowParallelLinear", "linear", I, H))
    return ModuleTree(model="fake", architecture="LlamaForCausalLM", hidden_size=H, num_layers=1, vocab_size=64,
                      dtype="bfloat16", layers_path="model.layers", vllm_version="", nodes=nodes)


# ----------------------------------------------------------------------------- fake shards


class Layer:
    """A Llama / Qwen3 decoder layer (layer 0: no incoming residual) in float64."""

    def __init__(self, config: dict, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.H = config["hidden_size"]
        self.nh = config["num_attention_heads"]
        self.kv = config["num_key_value_heads"]
        self.hd = config.get("head_dim") or self.H // self.nh
        self.inter = config["intermediate_size"]
        self.qk_norm = config["model_type"] == "qwen3"

        def w(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5

        self.wq = w(self.nh * self.hd, self.H)
        self.wk, self.wv = w(self.kv * self.hd, self.H), w(self.kv * self.hd, self.H)
        self.wo = w(self.H, self.nh * self.hd)
        self.wg, self.wu, self.wd = w(self.inter, self.H), w(self.inter, self.H), w(self.H, self.inter)
        self.n_in, self.n_post = 1 + 0.1 * w(self.H), 1 + 0.1 * w(self.H)
        self.n_q, self.n_k = 1 + 0.1 * w(self.hd), 1 + 0.1 * w(self.hd)

    # --- weights per rank, as vLLM's weight loaders narrow the checkpoint's
    def rank_weights(self, tp: int, r: int) -> dict:
        q_loc = self.nh // tp
        if tp >= self.kv:  # QKVParallelLinear: one kv head per rank, num_kv_head_replicas ranks share it
            kv_loc, replicas = 1, tp // self.kv
        else:
            kv_loc, replicas = self.kv // tp, 1
        shard_rank = r // replicas
        hd, i_loc = self.hd, self.inter // tp
        wk = self.wk.narrow(0, shard_rank * kv_loc * hd, kv_loc * hd)
        wv = self.wv.narrow(0, shard_rank * kv_loc * hd, kv_loc * hd)
        return dict(
            q_heads=q_loc, kv_heads=kv_loc,
            wqkv=torch.cat([self.wq.narrow(0, r * q_loc * hd, q_loc * hd), wk, wv]),           # [q_r | k_r | v_r]
            wo=self.wo.narrow(1, r * q_loc * hd, q_loc * hd),                                  # RowParallel input dim
            wgu=torch.cat([self.wg.narrow(0, r * i_loc, i_loc), self.wu.narrow(0, r * i_loc, i_loc)]),  # [g_r | u_r]
            wd=self.wd.narrow(1, r * i_loc, i_loc),
        )

    def full_weights(self) -> dict:
        return dict(q_heads=self.nh, kv_heads=self.kv, wqkv=torch.cat([self.wq, self.wk, self.wv]), wo=self.wo,
                    wgu=torch.cat([self.wg, self.wu]), wd=self.wd)

    # --- the forward: the first half (to the row-parallel o_proj) per rank, then all-reduce, ...
    def attention_half(self, h, wts, edit=None) -> dict:
        """Points up to o_proj's partial output, for one rank's weights (or the full ones)."""
        edit = edit or (lambda name, t: t)
        T, hd, nq, nkv = h.shape[0], self.hd, wts["q_heads"], wts["kv_heads"]
        x = _rms(h, self.n_in)
        qkv = edit("qkv", x @ wts["wqkv"].T)
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        v = edit("v", v)
        out = {"x": x, "qkv": qkv, "q": q, "k": k, "v": v}
        if self.qk_norm:
            q = _rms(q.view(T, nq, hd), self.n_q).reshape(T, nq * hd)
            k = _rms(k.view(T, nkv, hd), self.n_k).reshape(T, nkv * hd)
            out.update(qn=q, kn=k)
        q, k = _rope(q, hd), _rope(k, hd)
        group = nq // nkv  # local q head j reads local kv head j // group, as vLLM's attention does
        qh, kh, vh = q.view(T, nq, hd), k.view(T, nkv, hd), v.view(T, nkv, hd)
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
        s = torch.einsum("thd,shd->hts", qh, kh) / hd ** 0.5
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        attn = torch.einsum("hts,shd->thd", s.softmax(-1), vh).reshape(T, nq * hd)
        out.update(q_rope=q, attn=attn, o_part=attn @ wts["wo"].T)
        return out

    def mlp_half(self, h2, wts, edit=None) -> dict:
        edit = edit or (lambda name, t: t)
        gu = h2 @ wts["wgu"].T
        g, u = gu.chunk(2, dim=-1)
        act = edit("act", torch.nn.functional.silu(g) * u)
        return {"gu": gu, "act": act, "down_part": act @ wts["wd"].T}

    def run(self, h, tp: int | None, edit=None) -> tuple[dict, list[dict]]:
        """(replicated tensors, per-rank local tensors); tp None: the single-GPU layer."""
        parts = [self.full_weights()] if tp is None else [self.rank_weights(tp, r) for r in range(tp)]
        att = [self.attention_half(h, w, edit and (lambda n, t, r=r: edit(n, t, r))) for r, w in enumerate(parts)]
        o = sum(a["o_part"] for a in att)  # RowParallelLinear's all-reduce
        resid = o + h
        h2 = _rms(resid, self.n_post)
        mlp = [self.mlp_half(h2, w, edit and (lambda n, t, r=r: edit(n, t, r))) for r, w in enumerate(parts)]
        down = sum(m["down_part"] for m in mlp)
        rep = {"h": h, "x": att[0]["x"], "o": o, "resid": resid, "h2": h2, "down": down}
        return rep, [{**a, **m} for a, m in zip(att, mlp)]


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, hd):
    """Neox rotary per head (positions 0..T-1): acts inside each head, so it moves no column."""
    T = x.shape[0]
    xh = x.view(T, -1, hd)
    freq = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * freq[None]
    cos, sin = ang.cos()[:, None].repeat(1, 1, 2), ang.sin()[:, None].repeat(1, 1, 2)
    x1, x2 = xh.chunk(2, -1)
    return (xh * cos + torch.cat([-x2, x1], -1) * sin).reshape(T, -1)


# Point key (after `model.layers.0.`) -> the tensor it reads: "r:NAME" replicated, "l:NAME" local per rank.
POINTS = {
    "input": "r:h", "output[0]": "r:down", "output[1]": "r:resid", "resid": "r:resid+down",
    "input_layernorm.input": "r:h", "input_layernorm.output": "r:x",
    "self_attn.input": "r:x", "self_attn.output": "r:o",
    "self_attn.qkv_proj.input": "r:x", "self_attn.qkv_proj.output": "l:qkv",
    "self_attn.source.self_qkv_proj_0.input": "r:x", "self_attn.source.self_qkv_proj_0.output": "l:qkv",
    "self_attn.source.qkv_split_0.input": "l:qkv", "self_attn.source.qkv_split_0.output[0]": "l:q",
    "self_attn.source.qkv_split_0.output[1]": "l:k", "self_attn.source.qkv_split_0.output[2]": "l:v",
    "self_attn.q_norm.input": "l:q", "self_attn.q_norm.output": "l:qn",
    "self_attn.k_norm.input": "l:k", "self_attn.k_norm.output": "l:kn",
    "self_attn.source.self_q_norm_0.input": "l:q", "self_attn.source.self_q_norm_0.output": "l:qn",
    "self_attn.source.self_k_norm_0.input": "l:k", "self_attn.source.self_k_norm_0.output": "l:kn",
    "self_attn.attn.input": "l:q_rope", "self_attn.attn.output": "l:attn",
    "self_attn.source.self_attn_0.input": "l:q_rope", "self_attn.source.self_attn_0.output": "l:attn",
    "self_attn.o_proj.input": "l:attn", "self_attn.o_proj.output": "r:o",
    "self_attn.source.self_o_proj_0.input": "l:attn", "self_attn.source.self_o_proj_0.output": "r:o",
    "post_attention_layernorm.input": "r:o", "post_attention_layernorm.output": "r:h2",
    "mlp.input": "r:h2", "mlp.output": "r:down",
    "mlp.gate_up_proj.input": "r:h2", "mlp.gate_up_proj.output": "l:gu",
    "mlp.act_fn.input": "l:gu", "mlp.act_fn.output": "l:act", "mlp.down_proj.input": "l:act",
    "mlp.down_proj.output": "r:down",
    "mlp.source.self_gate_up_proj_0.input": "r:h2", "mlp.source.self_gate_up_proj_0.output": "l:gu",
    "mlp.source.self_act_fn_0.input": "l:gu", "mlp.source.self_act_fn_0.output": "l:act",
    "mlp.source.self_down_proj_0.input": "l:act", "mlp.source.self_down_proj_0.output": "r:down",
    "source.self_input_layernorm_0.input": "r:h", "source.self_input_layernorm_0.output": "r:x",
    "source.self_self_attn_0.input": "r:x", "source.self_self_attn_0.output": "r:o",
    "source.self_post_attention_layernorm_0.input": "r:o", "source.self_post_attention_layernorm_0.output[0]": "r:h2",
    "source.self_mlp_0.input": "r:h2", "source.self_mlp_0.output": "r:down",
}
# Points the tree offers that layer 0 never runs (a norm's (out, residual) elements, the norm
# called with a residual): checked to share the layout of the point they stand beside.
NOT_RUN = {"source.self_input_layernorm_1.input": "source.self_input_layernorm_0.input",
           "source.self_input_layernorm_1.output": "source.self_input_layernorm_0.output",
           # the residual the norm passes on beside its output (hidden width, replicated)
           "source.self_post_attention_layernorm_0.output[1]": "source.self_post_attention_layernorm_0.output[0]",
           **{f"{norm}.output[{k}]": f"{norm}.output" for k in (0, 1) for norm in
              ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")}}


def _tree_points(tree, layer: str) -> list[str]:
    """Every point the tree offers inside `layer`, as resolve names them."""
    keys = []
    for n in tree.nodes:
        if n.path != layer and not n.path.startswith(layer + "."):
            continue
        if n.output == "pair":
            keys += [f"{n.path}.output[0]", f"{n.path}.output[1]", f"{n.path}.resid"]
        elif n.output in ("tensor", "linear", "norm") and n.out_width:
            keys.append(f"{n.path}.output")
            if n.output == "norm":
                keys += [f"{n.path}.output[0]", f"{n.path}.output[1]"]
        if n.in_width and n.output != "none":
            keys.append(f"{n.path}.input")
        for op in n.source_ops:
            if op.out_widths:
                keys += [f"{n.path}.source.{op.name}.output" + (f"[{k}]" if len(op.out_widths) > 1 else "")
                         for k in range(len(op.out_widths))]
            if op.in_width:
                keys.append(f"{n.path}.source.{op.name}.input")
    return keys


def _suffix(key: str) -> str:
    return key[len(LAYER) + 1:]


def _tensors(ref: str, full: dict, full_locals: dict, ranks: list[dict], tp: int):
    """(single-GPU tensor, [rank's local tensor]) of a POINTS entry."""
    kind, name = ref.split(":")
    if kind == "r":
        def get(d):
            return sum(d[n] for n in name.split("+"))
        return get(full), [get(full)] * tp
    return full_locals[name], [r[name] for r in ranks]


def _place(shard, locals_):
    """Each rank copies its `writes` into one host block; count how often each column is written."""
    host = torch.full((locals_[0].shape[0], shard.width), float("nan"), dtype=torch.float64)
    written = np.zeros(shard.width, dtype=int)
    for part, local in zip(shard.ranks, locals_):
        assert local.shape[1] == part.local_width, f"{shard.key} rank {part.rank}: local width"
        for dst, src, n in part.writes:
            host[:, dst:dst + n] = local[:, src:src + n]
            written[dst:dst + n] += 1
    return host, written


@pytest.mark.parametrize("name,tp", CASES)
def test_captures_land_in_the_single_gpu_layout(models, name, tp):
    tree, config, dims = models[name]
    layer = Layer(config, seed=tp)
    h = torch.randn(7, layer.H, dtype=torch.float64)
    full, (full_locals,) = layer.run(h, None)
    rep, ranks = layer.run(h, tp)
    torch.testing.assert_close(rep["down"], full["down"])  # the fake shards compute the same layer
    keys = _tree_points(tree, LAYER)
    unknown = {_suffix(k) for k in keys} - set(POINTS) - set(NOT_RUN)
    assert not unknown, f"points of the tree without a reference here: {sorted(unknown)}"
    shards = shard_points(tree, keys, dims, tp=tp)
    for key in keys:
        shard = shards[key]
        assert shard.refused is None, shard.refused
        if _suffix(key) in NOT_RUN:
            assert shard.layout == shards[f"{LAYER}.{NOT_RUN[_suffix(key)]}"].layout, key
            continue
        whole, locals_ = _tensors(POINTS[_suffix(key)], full, full_locals, ranks, tp)
        assert (shard.layout == REPLICATED) == POINTS[_suffix(key)].startswith("r:"), f"{key}: {shard.layout}"
        host, written = _place(shard, locals_)
        assert (written == 1).all(), f"{key}: columns written {sorted(set(written.tolist()))} times"
        torch.testing.assert_close(host, whole, msg=lambda m: f"{key} ({shard.layout}): {m}")
        gathered = torch.cat(locals_, dim=1)  # an all-gather on the last dim: rank after rank
        torch.testing.assert_close(gathered[:, gather_index(shard)], whole, msg=lambda m: f"{key} gathered: {m}")
        for r, local in enumerate(locals_):  # holds: every local column is the column it names
            torch.testing.assert_close(local, whole[:, global_columns(shard, r)], msg=lambda m: f"{key} rank {r}: {m}")


@pytest.mark.parametrize("name,tp", CASES)
def test_local_edits_equal_the_edit_on_the_whole_tensor(models, name, tp):
    tree, config, dims = models[name]
    layer = Layer(config, seed=100 + tp)
    h = torch.randn(5, layer.H, dtype=torch.float64)
    _, (full_locals,) = layer.run(h, None)
    _, ranks = layer.run(h, tp)
    g = np.random.default_rng(tp)
    sharded = [k for k in _tree_points(tree, LAYER) if POINTS.get(_suffix(k), "r:").startswith("l:")]
    shards = shard_points(tree, sharded, dims, tp=tp)
    for key, shard in shards.items():
        whole, locals_ = _tensors(POINTS[_suffix(key)], {}, full_locals, ranks, tp)
        vec = g.standard_normal(shard.width)
        cols = sorted(g.choice(shard.width, size=max(1, shard.width // 5), replace=False).tolist())
        vals = g.standard_normal(len(cols))
        edited = whole + torch.from_numpy(vec)
        edited[:, cols] = torch.from_numpy(vals)
        edited[:, cols[::2]] = 0.0
        out = []
        for r, local in enumerate(locals_):
            mine = local + torch.from_numpy(local_vector(shard, r, vec))
            lc, picked = local_columns(shard, r, cols)
            mine[:, lc] = torch.from_numpy(vals[picked])
            lz, _ = local_columns(shard, r, cols[::2])
            mine[:, lz] = 0.0
            torch.testing.assert_close(mine, edited[:, global_columns(shard, r)], msg=lambda m: f"{key} rank {r}: {m}")
            out.append(mine)
        host, _ = _place(shard, out)
        torch.testing.assert_close(host, edited, msg=lambda m: f"{key}: {m}")
        assert "project_out needs the whole row" in shard.refusal("project_out")
        assert shard.refusal("add") is None and shard.refusal("zero") is None


@pytest.mark.parametrize("name,tp", CASES)
def test_edits_on_shards_flow_through_the_layer_as_on_one_gpu(models, name, tp):
    """add on v (kv heads held by several ranks edited on each) and on act_fn's output, per rank,
    give the single-GPU layer's output under the same edit."""
    tree, config, dims = models[name]
    layer = Layer(config, seed=200 + tp)
    h = torch.randn(6, layer.H, dtype=torch.float64)
    v_key, act_key = f"{LAYER}.self_attn.source.qkv_split_0.output[2]", f"{LAYER}.mlp.act_fn.output"
    shards = shard_points(tree, [v_key, act_key], dims, tp=tp)
    g = np.random.default_rng(tp)
    vec = {"v": g.standard_normal(shards[v_key].width), "act": g.standard_normal(shards[act_key].width)}
    key_of = {"v": v_key, "act": act_key}

    def full_edit(name, t, r):
        return t + torch.from_numpy(vec[name]) if name in vec else t

    def rank_edit(name, t, r):
        return t + torch.from_numpy(local_vector(shards[key_of[name]], r, vec[name])) if name in vec else t

    full, _ = layer.run(h, None, edit=full_edit)
    rep, _ = layer.run(h, tp, edit=rank_edit)
    plain, _ = layer.run(h, None)
    assert not torch.allclose(full["down"], plain["down"])  # the edit changes the output
    torch.testing.assert_close(rep["down"], full["down"])
    torch.testing.assert_close(rep["o"], full["o"])


# ----------------------------------------------------------------------------- refusals, sizes, stages


def test_sizes_vllm_refuses_are_refused_by_name(models):
    tree, _, dims = models["odd"]
    with pytest.raises(PlanError, match="tensor_parallel_size=4 does not divide the 6 attention heads"):
        shard_points(tree, [], dims, tp=4)
    with pytest.raises(PlanError, match="tensor_parallel_size=2 and the 3 kv heads"):
        shard_points(tree, [], dims, tp=2)
    with pytest.raises(PlanError, match="pipeline_parallel_size=6 is more than the model's 5 decoder layers"):
        shard_points(tree, [], dims, pp=6)
    wrong = ModelDims(num_heads=6, num_kv_heads=3, head_dim=32)
    with pytest.raises(PlanError, match="qkv_proj: 192 columns, but the config says"):
        shard_points(tree, [], wrong, tp=3)


def test_local_widths_are_each_gpus_share(models):
    """What tapc/plan/sizing.py sizes each GPU's buffers by (gpu_bytes is tested in test_parallel)."""
    tree, _, dims = models["llama"]  # 8 heads, 4 kv heads, head_dim 32, intermediate 704
    keys = [f"{LAYER}.self_attn.qkv_proj.output", f"{LAYER}.mlp.act_fn.output", f"{LAYER}.resid"]
    for tp in (1, 2, 8):
        s = shard_points(tree, keys, dims, tp=tp)
        kv_local = max(1, 4 // tp) * 32
        for key, want in zip(keys, (8 * 32 // tp + 2 * kv_local, 704 // tp, 256)):
            assert [r.local_width for r in s[key].ranks] == [want] * tp, key


def test_points_inside_a_moe_block_are_refused_with_the_block_to_tap(trees):
    tree = trees("qwen2_moe")
    config = json.loads((CONFIGS / "qwen2_moe" / "config.json").read_text())
    dims = ModelDims.from_config(config)
    inside = f"{LAYER}.mlp.shared_expert.down_proj.output"  # a partial sum: reduced only with the experts'
    keys = [inside, f"{LAYER}.mlp.output", f"{LAYER}.mlp.gate.output", f"{LAYER}.self_attn.qkv_proj.output"]
    s = shard_points(tree, keys, dims, tp=2)
    assert s[inside].layout == REFUSED and s[inside].refusal("add") == s[inside].refused
    assert f"mixture-of-experts block {LAYER}.mlp" in s[inside].refused
    assert f"tap {LAYER}.mlp.output" in s[inside].refused
    assert [s[k].layout for k in keys[1:]] == [REPLICATED, REPLICATED, "qkv"]
    assert shard_points(tree, [inside], dims, tp=1)[inside].layout == REPLICATED  # one GPU: no sums to miss


@pytest.mark.parametrize("layers,pp,partition", [(4, 2, None), (5, 2, None), (10, 4, None), (7, 3, None),
                                                 (32, 3, None), (80, 6, None), (10, 2, "1,9"), (5, 3, "2,2,1")])
def test_pp_stages_match_vllm(monkeypatch, layers, pp, partition):
    from vllm.distributed.utils import get_pp_indices

    if partition:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    else:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert pp_stages(layers, pp) == tuple(get_pp_indices(layers, r, pp) for r in range(pp))


def test_pp_partition_errors_name_the_variable():
    with pytest.raises(PlanError, match="VLLM_PP_LAYER_PARTITION='3,3': needs 2 counts .* summing to the model's 5"):
        pp_stages(5, 2, "3,3")
    with pytest.raises(PlanError, match="comma-separated"):
        pp_stages(5, 2, "3;2")


def test_points_go_to_their_stage(models):
    tree, _, dims = models["odd"]  # 5 layers over 2 stages: vLLM gives 3 to the first
    keys = ["model.embed_tokens.output", "model.layers.2.resid", "model.layers.3.mlp.act_fn.output",
            "model.norm.output", "model.source.self_norm_0.output", "logits", "samples"]
    s = shard_points(tree, keys, dims, tp=3, pp=2, pp_partition="")
    assert [s[k].stage for k in keys] == [0, 0, 1, 1, 1, 1, 1]
    s = shard_points(tree, keys, dims, pp=2, pp_partition="2,3")
    assert s["model.layers.2.resid"].stage == 1


def test_results_are_plain_data(models):
    tree, _, dims = models["qwen3"]
    key = f"{LAYER}.self_attn.qkv_proj.output"
    shard = shard_points(tree, [Point(f"{LAYER}.self_attn.qkv_proj")], dims, tp=4)[key]
    back = json.loads(json.dumps(shard.to_dict()))
    assert back["layout"] == "qkv" and back["ranks"][1]["writes"] == [list(r) for r in shard.ranks[1].writes]
    for key in (key, f"{LAYER}.source.self_mlp_0.input", f"{LAYER}.self_attn.source.qkv_split_0.output[2]",
                f"{LAYER}.output[1]", "logits"):
        assert parse_key(key).key == key
    with pytest.raises(PlanError, match="not a point key"):
        parse_key("model.layers.0.mlp")
    with pytest.raises(PlanError, match="rotary_emb.output: not a tappable point"):
        shard_points(tree, [f"{LAYER}.self_attn.rotary_emb.output"], dims, tp=2)
    with pytest.raises(PlanError, match="no module 'model.layers.0.mlp.up'"):
        shard_points(tree, [f"{LAYER}.mlp.up.output"], dims, tp=2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen2_moe"])
def test_every_point_of_a_tree_gets_a_layout_or_says_what_to_tap(trees, arch):
    tree = trees(arch)
    dims = ModelDims.of_model(str(CONFIGS / arch))
    keys = _tree_points(tree, "model") + ["logits", "samples"]
    assert all(s.layout == REPLICATED for s in shard_points(tree, keys, dims, tp=1).values())
    at2 = shard_points(tree, keys, dims, tp=2)
    for key, s in at2.items():
        if s.refused:
            assert s.layout == REFUSED and not s.ranks and " instead" in s.refused and ".output" in s.refused, s.refused
            continue
        written = np.zeros(s.width, dtype=int)
        for part in s.ranks:
            for dst, _, n in part.writes:
                written[dst:dst + n] += 1
            held = global_columns(s, part.rank).tolist()
            assert len(set(held)) == len(held) == part.local_width, key
        assert (written == 1).all(), key
    refused = {k for k, s in at2.items() if s.refused}
    assert all(".mlp." in k for k in refused) and bool(refused) == (arch == "qwen2_moe")


def test_bad_input_is_refused_by_name(models, trees):
    tree, _, dims = models["qwen3"]
    qkv = f"{LAYER}.self_attn.qkv_proj.output"
    with pytest.raises(PlanError, match="tensor_parallel_size=0, pipeline_parallel_size=1: both must be at least 1"):
        shard_points(tree, [qkv], dims, tp=0)
    with pytest.raises(PlanError, match="a `.source` key reads <module>.source.<op>.input|output"):
        parse_key(f"{LAYER}.self_attn.source.qkv_split_0")
    with pytest.raises(PlanError, match="no `.source` op 'qkv_split_9' in Qwen3Attention.forward"):
        shard_points(tree, [f"{LAYER}.self_attn.source.qkv_split_9.output[0]"], dims, tp=2)
    shard = shard_points(tree, [qkv], dims, tp=2)[qkv]
    with pytest.raises(PlanError, match=r"qkv_proj.output: a vector of 511 numbers for a point 512 wide"):
        local_vector(shard, 0, np.zeros(511))
    with pytest.raises(PlanError, match="column 512 is past the point's width 512"):
        local_columns(shard, 1, [3, 512])
    moe_tree = trees("qwen2_moe")
    moe_dims = ModelDims.of_model(str(CONFIGS / "qwen2_moe"))
    inside = f"{LAYER}.mlp.shared_expert.act_fn.output"
    refused = shard_points(moe_tree, [inside], moe_dims, tp=2)[inside]
    for use in (global_columns, lambda s, r: local_vector(s, r, np.zeros(s.width)), lambda s, r: gather_index(s)):
        with pytest.raises(PlanError, match="inside the mixture-of-experts block"):
            use(refused, 0)


@pytest.mark.parametrize("name,site", [("llama", "self_attn.qkv_proj.output"), ("mqa", "self_attn.qkv_proj.output"),
                                       ("llama", "mlp.act_fn.output"), ("kv2", "self_attn.attn.output")])
def test_a_block_at_a_sharded_point_sees_whole_rows_and_each_gpu_keeps_its_columns(models, name, site):
    """Two GPUs' block runtimes, each with only its columns, gathered through a real two-party
    all-gather (threads at a barrier): every GPU's block sees the single-GPU rows, and each
    GPU's columns end as the block's result's (replicated kv heads on both)."""
    import threading

    from tapc.worker.runtime import BlockPoint, BlockRuntime, Sharded, Span

    tree, _, dims = models[name]
    key = f"{LAYER}.{site}"
    shard = shard_points(tree, [key], dims, tp=2)[key]
    assert shard.sharded
    whole = torch.randn(9, shard.width, generator=torch.Generator().manual_seed(5))
    edited = whole.clone()
    edited[2:6] = edited[2:6] * 3 + torch.arange(shard.width)     # what the block does to request a's rows
    barrier, put, calls = threading.Barrier(2), {}, []

    def all_gather(rank):
        def gather(t):
            calls.append(rank)
            put[rank] = t.clone()
            barrier.wait()
            out = torch.cat([put[0], put[1]], dim=-1)
            barrier.wait()
            return out
        return gather

    seen, locals_ = {}, {}

    def block(ctx, x):
        seen.setdefault(threading.current_thread().name, []).append(x.clone())
        x.mul_(3).add_(torch.arange(x.shape[1]))

    def rank_run(rank):
        cols = torch.as_tensor(global_columns(shard, rank))
        local = whole[:, cols].clone()
        rt = BlockRuntime([BlockPoint(key, "f", Sharded(torch.as_tensor(gather_index(shard)),
                                                        shard.ranks[rank].holds, all_gather(rank)))])
        rt.register({"f": block})
        rt.admit("a", 10)
        rt.begin_step([Span("a", 2, 6, 0), Span("b", 6, 8, 0)])   # b runs no block
        rt(0, local, None)
        rt.begin_step([Span("b", 0, 1, 8)])                        # nothing admitted: no collective
        rt(0, local, None)
        locals_[rank] = (local, cols)

    threads = [threading.Thread(target=rank_run, args=(r,), name=f"rank{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(calls) == [0, 1], "one all-gather per GPU, none in the step without blocks"
    for r in range(2):
        (x,) = seen[f"rank{r}"]
        assert torch.equal(x, whole[2:6]), f"rank {r}'s block saw other than the single-GPU rows"
        local, cols = locals_[r]
        assert torch.equal(local, edited[:, cols]), f"rank {r}'s columns are not the block's result"

