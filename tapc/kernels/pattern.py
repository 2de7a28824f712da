"""Attention patterns: a query row's softmax weights over its request's keys, from the paged KV cache.

For each row t of the step that a request captures (`dst[t] >= 0`), the row's request s is
found from the attention's `query_start_loc` (the first rows of each request), its position
p = seq_lens[s] - (query_start_loc[s + 1] - t), and for each head asked, h = heads[i]:

    w[j] = softmax_j(q[t, h] . k[j, h // group] * scale),   j = 0..p
    out[dst[t], i * keys + j] = w[j] for j <= p, 0 for p < j < keys

with k[j] read through the request's block table (`block_table[s, j // block_size]`, slot
j % block_size) from the cache the attention has just written: the keys of a cached prefix and
of earlier steps are there as well as this step's. That is HF's eager attention (causal, no
window), computed in fp32: the row equals `output_attentions=True`'s `[heads, p + 1]`, padded.

One program a (row, head) pair: a row no request asks for costs its program one load. Two
passes over the keys: the running max and sum, then the weights written.
"""
import torch
import triton
import triton.language as tl

from .capture import PHASES
from .common import check_ring, check_row_table

BLOCK_N = 64        # keys a step of a pass reads
SCAN = 128          # entries of query_start_loc a step of the request search reads


@triton.jit
def _scores(q, table, k_head, j, p, d, dm, block_size, stride_kb, stride_ks, scale):
    """q . k[j] * scale for the keys j (-inf past p), each read through the request's block table."""
    ok = j <= p
    blk = tl.load(table + j // block_size, mask=ok, other=0).to(tl.int64)
    kk = tl.load(k_head + blk[:, None] * stride_kb + (j % block_size)[:, None] * stride_ks + d[None, :],
                 mask=ok[:, None] & dm[None, :], other=0.0).to(tl.float32)
    return tl.where(ok, tl.sum(kk * q[None, :], axis=1) * scale, float("-inf"))


@triton.jit
def _pattern_kernel(
    q_ptr, k_ptr, dst_ptr, out_ptr, heads_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, n_reqs, scale, keys,
    block_size, group, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_out,
    ring_ptr, pos_ptr, ring_stride,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr,
    RING: tl.constexpr, PHASES: tl.constexpr,
):
    t = tl.program_id(0)
    i = tl.program_id(1)
    dst = tl.load(dst_ptr + t).to(tl.int64)
    if RING:   # as capture.py's rings: the row's phase past its block
        start = tl.load(ring_ptr + t).to(tl.int64)
        phase = (tl.load(pos_ptr + t).to(tl.int64) - start) & (PHASES - 1)
        dst = tl.where((dst >= 0) & (start >= 0), dst + phase * ring_stride, dst)
    if dst >= 0:
        # the row's request: how many requests end at or before it
        s = 0
        for j0 in range(0, n_reqs, SCAN):
            offs = j0 + 1 + tl.arange(0, SCAN)
            ends = tl.load(qsl_ptr + offs, mask=offs <= n_reqs, other=2147483647)
            s += tl.sum((ends <= t).to(tl.int32), axis=0)
        p = tl.load(seq_lens_ptr + s) - (tl.load(qsl_ptr + s + 1) - t)
        h = tl.load(heads_ptr + i)
        kvh = h // group
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + h * stride_qh + d, mask=dm, other=0.0).to(tl.float32)
        table = bt_ptr + s.to(tl.int64) * stride_bt
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        m_i = float("-inf")
        l_i = 0.0
        for n0 in range(0, p + 1, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            sc = _scores(q, table, k_head, j, p, d, dm, block_size, stride_kb, stride_ks, scale)
            m_new = tl.maximum(m_i, tl.max(sc, axis=0))
            l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(sc - m_new), axis=0)
            m_i = m_new
        row = out_ptr + dst * stride_out + i * keys
        for n0 in range(0, keys, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            sc = _scores(q, table, k_head, j, p, d, dm, block_size, stride_kb, stride_ks, scale)
            w = tl.where(j <= p, tl.exp(sc - m_i) / l_i, 0.0)
            tl.store(row + j, w, mask=j < keys)


def _check(q, key_cache, dst, out, heads, query_start_loc, seq_lens, block_table, keys):
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    if key_cache.dim() != 4 or key_cache.shape[3] != q.shape[2] or key_cache.stride(3) != 1:
        raise ValueError(f"key_cache must be [blocks, block_size, kv_heads, {q.shape[2]}] with unit stride in its "
                         f"last dimension, got shape {tuple(key_cache.shape)}, strides {key_cache.stride()}")
    if q.stride(2) != 1 or q.shape[1] % key_cache.shape[2]:
        raise ValueError(f"q must have unit stride in head_dim and a multiple of key_cache's {key_cache.shape[2]} "
                         f"heads, got shape {tuple(q.shape)}, strides {q.stride()}")
    check_row_table(dst, q[:, 0], "dst")
    if out.dtype != torch.float32 or out.dim() != 2 or out.shape[1] < heads.shape[0] * keys or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [rows, >= {heads.shape[0]} heads x {keys} keys], got {out.dtype} "
                         f"{tuple(out.shape)}")
    for name, t in (("heads", heads), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name} must be 1-D int32, got {t.dtype} of shape {tuple(t.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be [requests, blocks] int32, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if seq_lens.shape[0] < query_start_loc.shape[0] - 1:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {query_start_loc.shape[0] - 1} requests")


def pattern(q: torch.Tensor, key_cache: torch.Tensor, dst: torch.Tensor, out: torch.Tensor, heads: torch.Tensor,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
            keys: int, ring: torch.Tensor | None = None, pos: torch.Tensor | None = None, stride: int = 0) -> None:
    """The patterns of the rows `dst` asks for, heads `heads`, into `out` (Triton). `q` is the
    attention's query `[tokens, heads, head_dim]`, `key_cache` its layer's keys `[blocks,
    block_size, kv_heads, head_dim]` (any strides but the last), the other tensors its metadata
    (vLLM's names); `keys` the columns a head takes of a pool row."""
    _check(q, key_cache, dst, out, heads, query_start_loc, seq_lens, block_table, keys)
    check_ring(ring, pos, q[:, 0])
    n = q.shape[0]
    if n == 0:
        return
    head_dim = q.shape[2]
    _pattern_kernel[(n, heads.shape[0])](
        q, key_cache, dst, out, heads, query_start_loc, seq_lens, block_table, query_start_loc.shape[0] - 1,
        scale, keys, key_cache.shape[1], q.shape[1] // key_cache.shape[2], q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0), out.stride(0),
        dst if ring is None else ring, dst if pos is None else pos, stride,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=BLOCK_N, SCAN=SCAN,
        RING=ring is not None, PHASES=PHASES, num_warps=4,
    )


def pattern_ref(q, key_cache, dst, out, heads, query_start_loc, seq_lens, block_table, scale, keys,
                ring=None, pos=None, stride=0) -> None:
    """Plain-torch reference of `pattern`: each asked row's keys gathered and softmaxed in fp32."""
    n = q.shape[0]
    d = dst[:n].long()
    if ring is not None:
        start = ring[:n].long()
        d = torch.where((d >= 0) & (start >= 0), d + ((pos[:n].long() - start) & (PHASES - 1)) * stride, d)
    group = q.shape[1] // key_cache.shape[2]
    block_size = key_cache.shape[1]
    ends = query_start_loc[1:].long()
    for t in (d >= 0).nonzero().flatten().tolist():
        s = int((ends <= t).sum())
        p = int(seq_lens[s]) - (int(query_start_loc[s + 1]) - t)
        j = torch.arange(p + 1, device=q.device)
        blocks = block_table[s].long()[j // block_size]
        row = out[d[t]]
        row[: heads.shape[0] * keys] = 0
        for i, h in enumerate(heads.tolist()):
            k = key_cache[blocks, j % block_size, h // group].float()
            w = torch.softmax(k @ q[t, h].float() * scale, dim=0)[:keys]
            row[i * keys: i * keys + w.shape[0]] = w
