"""An attention pattern's op as the engine installs it (tapc/worker/install.py `_Pattern`): around
the attention backend's forward, on the cache and metadata vLLM hands that forward, into the
capture pool its row table names. The backend here is a stand-in with FlashAttention's class
name, attributes and cache layout; the weights are checked against softmax(q k^T) over each
request's contiguous keys, written before they were paged."""
from types import SimpleNamespace

import pytest
import torch
from engine_toy import LAYERS, attention_nodes, toy_buffers, toy_tree
from kernel_cases import paged_keys

from tapc.errors import EngineError
from tapc.plan.planner import build_plan
from tapc.plan.sharding import ModelDims
from tapc.worker.install import install
from tapc.worker.layout import Layout

HEADS, KV_HEADS, HEAD_DIM, BLOCK, KEYS = 4, 2, 8, 16, 40


class FlashAttentionImpl:
    """vLLM's FlashAttention backend as `_Pattern` reads it: its attributes, and a forward that
    writes the attention's output (here: zeros)."""

    def __init__(self, **changed):
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5
        self.kv_cache_dtype, self.sliding_window, self.logits_soft_cap = "auto", (-1, -1), 0.0
        self.alibi_slopes = self.sinks = None
        self.dcp_world_size = 1
        self.calls = 0
        vars(self).update(changed)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, **kwargs):
        self.calls += 1
        return output.zero_()


class Model(torch.nn.Module):
    """`model.layers.<i>.self_attn.attn`: vLLM's module path of each layer's attention."""

    def __init__(self, impl=FlashAttentionImpl):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(LAYERS):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            layer.self_attn.attn = torch.nn.Module()
            layer.self_attn.attn.impl = impl()
            self.model.layers.append(layer)


def planned(tap: str):
    plan = build_plan("toy", [tap], max_num_batched_tokens=64, max_num_seqs=4, tree=toy_tree(mlp=attention_nodes),
                      dims=ModelDims(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM))
    layout = Layout(plan)
    return layout, toy_buffers(layout, rows=64, slots=4)


def step(seq_lens, query_lens):
    """One step of requests with contiguous keys, paged into FlashAttention's cache layout."""
    keys = [torch.randn(n, KV_HEADS, HEAD_DIM) for n in seq_lens]
    kv_cache, table = paged_keys(keys, BLOCK)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = SimpleNamespace(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table)
    q = torch.randn(int(qsl[-1]), HEADS * HEAD_DIM)
    return keys, kv_cache, meta, q


def test_the_pattern_op_runs_after_the_attention_and_fills_the_asked_rows():
    torch.manual_seed(0)
    layout, buffers = planned("model.layers.1.self_attn.pattern | capture(heads=[3, 0], keys=40)")
    model = Model()
    install(model, layout, buffers)
    attn, other = model.model.layers[1].self_attn.attn, model.model.layers[0].self_attn.attn
    assert "forward" in vars(attn.impl) and "forward" not in vars(other.impl), "only the tapped layer's backend"
    seq_lens, query_lens = [37, 12], [9, 1]   # a prompt chunk behind 28 cached keys, a decode row
    keys, kv_cache, meta, q = step(seq_lens, query_lens)
    asked = {3: 5, 8: 0, 9: 2}   # step row -> pool row: request 0's rows 3 and 8, request 1's decode row
    for t, row in asked.items():
        buffers.table[0, t] = row
    pool = buffers.pools[0]
    pool.fill_(-7.0)
    out = torch.empty(q.shape[0], HEADS, HEAD_DIM)
    attn.impl.forward(attn, q.view(-1, HEADS, HEAD_DIM), None, None, kv_cache, meta, output=out)
    assert attn.impl.calls == 1
    for t, row in asked.items():
        s = 0 if t < 9 else 1
        p = seq_lens[s] - (int(meta.query_start_loc[s + 1]) - t)
        got = pool[row].view(2, KEYS)
        for i, h in enumerate((3, 0)):
            k = keys[s][: p + 1, h // (HEADS // KV_HEADS)]
            want = torch.softmax(k @ q[t].view(HEADS, HEAD_DIM)[h] * HEAD_DIM ** -0.5, dim=0)
            torch.testing.assert_close(got[i, : p + 1], want, rtol=1e-5, atol=1e-6)
            assert (got[i, p + 1:] == 0).all()
    untouched = [r for r in range(pool.shape[0]) if r not in asked.values()]
    assert (pool[untouched] == -7.0).all()
    # vLLM's profiling run hands no metadata: the attention runs, the pattern waits for a cache
    attn.impl.forward(attn, q.view(-1, HEADS, HEAD_DIM), None, None, kv_cache, None, output=out)
    assert attn.impl.calls == 2


@pytest.mark.parametrize("changed, says", [
    ({"sliding_window": (127, 0)}, "a sliding window"),
    ({"logits_soft_cap": 30.0}, "a logit soft cap"),
    ({"kv_cache_dtype": "fp8"}, "an unquantized KV cache; this engine's is fp8"),
    ({"num_heads": 2}, "this engine's attention has 2 heads; the plan asks for head 3"),
])
def test_an_attention_the_kernel_cannot_read_is_refused_at_load(changed, says):
    layout, buffers = planned("model.layers.0.self_attn.pattern | capture(keys=40)")
    with pytest.raises(EngineError, match=says):
        install(Model(lambda: FlashAttentionImpl(**changed)), layout, buffers)


def test_another_backend_is_refused_at_load_naming_it():
    class TritonAttentionImpl(FlashAttentionImpl):
        pass

    layout, buffers = planned("model.layers.0.self_attn.pattern | capture(keys=40)")
    with pytest.raises(EngineError, match="this layer runs TritonAttentionImpl"):
        install(Model(TritonAttentionImpl), layout, buffers)
