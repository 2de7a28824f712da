"""The logit lens: a point's rows through the model's final RMSNorm and unembedding, top k.

For each row i of the step that a request captures (`dst_ids[i] >= 0` or `dst_logits[i] >= 0`,
the row tables of the lens's two captures), with s = x[i] (+ b[i], the residual at a `resid`
point) added in fp32:

    h = norm_weight * (s * rsqrt(mean(s^2) + eps)).to(x.dtype)      (HF's LlamaRMSNorm)
    logits = h @ weight[:vocab].T                                    (fp32 accumulation)
    ids[dst_ids[i]], logits_out[dst_logits[i]] = the k largest, in descending order

Two launches, both of which read the row tables and do nothing for rows no request asks for:

- `_lens_block_kernel`, programs over (vocab blocks, row groups): the rows asked are found by a
  scan of the tables and taken `BLOCK_R` at a time, so that a block of the unembedding is read
  once for up to `BLOCK_R` rows (the last prompt position of many requests lies far apart in a
  step) and multiplied on the tensor cores; each program keeps its block's k best per row, in
  `cand_*[i]`, `k` columns a block;
- `_lens_topk_kernel`, a program a row: the k best of the row's candidates, into the pools.

`weight` is the model's own `lm_head.weight` and `norm_weight` its final norm's: nothing is copied.
"""
import torch
import triton
import triton.language as tl

from .common import INTERPRET, check_activation, check_partner, check_ring, check_row_table
from .capture import PHASES

BLOCK_R = 16      # rows one program multiplies at a time (tl.dot takes 16 or more)
BLOCK_H = 64      # hidden columns a step of the product takes
SCAN = 256        # row-table entries a step of the scan reads
GROUPS = 4        # programs over row groups a vocab block has: 64 rows in one pass


@triton.jit
def _asked(dst_a_ptr, dst_b_ptr, offs, n_rows):
    m = offs < n_rows
    da = tl.load(dst_a_ptr + offs, mask=m, other=-1)
    db = tl.load(dst_b_ptr + offs, mask=m, other=-1)
    return (da >= 0) | (db >= 0)


@triton.jit
def _lens_block_kernel(
    x_ptr, y_ptr, dst_a_ptr, dst_b_ptr, n_rows, norm_ptr, eps, w_ptr, vocab, hidden,
    cand_ids_ptr, cand_vals_ptr, stride_x, stride_y, stride_w, stride_c,
    K: tl.constexpr, HAS_Y: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr, SCAN: tl.constexpr, INTERPRETED: tl.constexpr,
    FP32: tl.constexpr,
):
    vb = tl.program_id(0)
    g = tl.program_id(1)
    groups = tl.num_programs(1)
    lanes = tl.arange(0, BLOCK_R)
    total = 0
    for s in range(0, n_rows, SCAN):
        total += tl.sum(_asked(dst_a_ptr, dst_b_ptr, s + tl.arange(0, SCAN), n_rows).to(tl.int32), axis=0)
    cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = cols < vocab
    for first in range(g * BLOCK_R, total, groups * BLOCK_R):
        # the step rows of the asked rows ranked first .. first + BLOCK_R - 1
        rows = tl.full([BLOCK_R], -1, tl.int32)
        seen = 0
        for s in range(0, n_rows, SCAN):
            offs = s + tl.arange(0, SCAN)
            asked = _asked(dst_a_ptr, dst_b_ptr, offs, n_rows)
            rank = tl.cumsum(asked.to(tl.int32), axis=0) - 1 + seen - first
            hit = asked[:, None] & (rank[:, None] == lanes[None, :])
            rows = tl.maximum(rows, tl.max(tl.where(hit, offs[:, None], -1), axis=0))
            seen += tl.sum(asked.to(tl.int32), axis=0)
        valid = rows >= 0
        r = tl.where(valid, rows, 0).to(tl.int64)
        sq = tl.zeros([BLOCK_R], dtype=tl.float32)
        for h in range(0, hidden, BLOCK_H):
            hc = h + tl.arange(0, BLOCK_H)
            m = valid[:, None] & (hc < hidden)[None, :]
            v = tl.load(x_ptr + r[:, None] * stride_x + hc[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_Y:
                v += tl.load(y_ptr + r[:, None] * stride_y + hc[None, :], mask=m, other=0.0).to(tl.float32)
            sq += tl.sum(v * v, axis=1)
        rstd = 1.0 / tl.sqrt(sq / hidden + eps)
        acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
        for h in range(0, hidden, BLOCK_H):
            hc = h + tl.arange(0, BLOCK_H)
            hm = hc < hidden
            m = valid[:, None] & hm[None, :]
            v = tl.load(x_ptr + r[:, None] * stride_x + hc[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_Y:
                v += tl.load(y_ptr + r[:, None] * stride_y + hc[None, :], mask=m, other=0.0).to(tl.float32)
            nw = tl.load(norm_ptr + hc, mask=hm, other=0.0).to(tl.float32)
            # rounded as HF rounds: the normalized row to the model's dtype, then times the weight
            normed = (v * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            a = (normed * nw[None, :]).to(w_ptr.dtype.element_ty)
            wt = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + hc[:, None],
                         mask=in_vocab[None, :] & hm[:, None], other=0.0)
            if INTERPRETED:   # the interpreter's dot of bf16 operands is wrong; fp32 holds their products exactly
                acc += tl.dot(a.to(tl.float32), wt.to(tl.float32))
            elif FP32:        # an fp32 model's lens in fp32, not TF32
                acc += tl.dot(a, wt, input_precision="ieee")
            else:
                acc += tl.dot(a, wt)
        acc = tl.where(in_vocab[None, :], acc, float("-inf"))
        out = r * stride_c + vb * K
        within = tl.arange(0, BLOCK_V)
        for t in tl.static_range(K):
            best = tl.max(acc, axis=1)
            at = tl.argmax(acc, axis=1)
            tl.store(cand_vals_ptr + out + t, best, mask=valid)
            tl.store(cand_ids_ptr + out + t, vb * BLOCK_V + at, mask=valid)
            acc = tl.where(within[None, :] == at[:, None], float("-inf"), acc)


@triton.jit
def _lens_topk_kernel(
    dst_a_ptr, dst_b_ptr, ids_ptr, vals_ptr, rows_a, rows_b, cand_ids_ptr, cand_vals_ptr, n_cand,
    stride_ids, stride_vals, stride_c, ring_ptr, pos_ptr, ring_a, ring_b,
    K: tl.constexpr, RING: tl.constexpr, PHASES: tl.constexpr, BLOCK_C: tl.constexpr,
):
    i = tl.program_id(0)
    da = tl.load(dst_a_ptr + i).to(tl.int64)
    db = tl.load(dst_b_ptr + i).to(tl.int64)
    if RING:   # as capture.py's rings: the row's phase past its block
        start = tl.load(ring_ptr + i).to(tl.int64)
        phase = (tl.load(pos_ptr + i).to(tl.int64) - start) & (PHASES - 1)
        da = tl.where((da >= 0) & (start >= 0), da + phase * ring_a, da)
        db = tl.where((db >= 0) & (start >= 0), db + phase * ring_b, db)
    ok_a = (da >= 0) & (da < rows_a)
    ok_b = (db >= 0) & (db < rows_b)
    if ok_a | ok_b:
        c = tl.arange(0, BLOCK_C)
        cm = c < n_cand
        base = i.to(tl.int64) * stride_c
        v = tl.load(cand_vals_ptr + base + c, mask=cm, other=float("-inf"))
        ids = tl.load(cand_ids_ptr + base + c, mask=cm, other=0)
        for t in tl.static_range(K):
            best = tl.max(v, axis=0)
            at = tl.argmax(v, axis=0)
            tl.store(vals_ptr + db * stride_vals + t, best, mask=ok_b)
            tl.store(ids_ptr + da * stride_ids + t, tl.sum(tl.where(c == at, ids, 0), axis=0), mask=ok_a)
            v = tl.where(c == at, float("-inf"), v)


def candidates(vocab: int, k: int, block_v: int) -> int:
    """Candidate columns a row needs: k for each block of `block_v` vocabulary entries."""
    return triton.cdiv(vocab, block_v) * k


def _check(x, b, dst_ids, dst_logits, ids, logits, norm_weight, weight, cand_ids, cand_vals, vocab, block_v):
    check_activation(x)
    if b is not None:
        check_partner(x, b)
    check_row_table(dst_ids, x, "dst_ids")
    check_row_table(dst_logits, x, "dst_logits")
    k = ids.shape[1]
    if ids.dtype != torch.int32 or logits.dtype != torch.float32 or logits.shape[1] != k:
        raise ValueError(f"ids must be int32 and logits float32, both [rows, k]; got {ids.dtype} "
                         f"{tuple(ids.shape)} and {logits.dtype} {tuple(logits.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or not 0 < k <= vocab <= weight.shape[0]:
        raise ValueError(f"weight must be [>= vocab ({vocab}), {x.shape[1]}] and k ({k}) at most vocab, got "
                         f"{tuple(weight.shape)}")
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm_weight must be [{x.shape[1]}], got {tuple(norm_weight.shape)}")
    need = candidates(vocab, k, block_v)
    for name, c, dtype in (("cand_ids", cand_ids, torch.int32), ("cand_vals", cand_vals, torch.float32)):
        if c.dtype != dtype or c.dim() != 2 or c.shape[0] < x.shape[0] or c.shape[1] < need:
            raise ValueError(f"{name} must be {dtype} [>= {x.shape[0]}, >= {need}], got {c.dtype} {tuple(c.shape)}")


def lens(x: torch.Tensor, b: torch.Tensor | None, dst_ids: torch.Tensor, dst_logits: torch.Tensor,
         ids: torch.Tensor, logits: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
         cand_ids: torch.Tensor, cand_vals: torch.Tensor, eps: float, vocab: int, block_v: int,
         ring: torch.Tensor | None = None, pos: torch.Tensor | None = None, stride_ids: int = 0,
         stride_logits: int = 0, between=None) -> None:
    """The lens's two launches (Triton), `between()` after the first (the engine's switch notes
    the graph node each launch made: tapc/kernels/ops.py)."""
    _check(x, b, dst_ids, dst_logits, ids, logits, norm_weight, weight, cand_ids, cand_vals, vocab, block_v)
    check_ring(ring, pos, x)
    n, hidden = x.shape
    if n == 0:
        return
    k = ids.shape[1]
    other = x if b is None else b
    _lens_block_kernel[(triton.cdiv(vocab, block_v), GROUPS)](
        x, other, dst_ids, dst_logits, n, norm_weight, eps, weight, vocab, hidden,
        cand_ids, cand_vals, x.stride(0), other.stride(0), weight.stride(0), cand_ids.stride(0),
        K=k, HAS_Y=b is not None, BLOCK_R=BLOCK_R, BLOCK_V=block_v, BLOCK_H=BLOCK_H, SCAN=SCAN,
        INTERPRETED=INTERPRET, FP32=weight.dtype == torch.float32, num_warps=4,
    )
    if between is not None:
        between()
    n_cand = candidates(vocab, k, block_v)
    _lens_topk_kernel[(n,)](
        dst_ids, dst_logits, ids, logits, ids.shape[0], logits.shape[0], cand_ids, cand_vals, n_cand,
        ids.stride(0), logits.stride(0), cand_ids.stride(0),
        dst_ids if ring is None else ring, dst_ids if pos is None else pos, stride_ids, stride_logits,
        K=k, RING=ring is not None, PHASES=PHASES, BLOCK_C=triton.next_power_of_2(n_cand), num_warps=4,
    )


def lens_ref(x, b, dst_ids, dst_logits, ids, logits, norm_weight, weight, cand_ids, cand_vals, eps, vocab, block_v,
             ring=None, pos=None, stride_ids=0, stride_logits=0) -> None:
    """Plain-torch reference of `lens` (the candidates are not used)."""
    n = x.shape[0]
    d = {"ids": dst_ids[:n].long(), "logits": dst_logits[:n].long()}
    if ring is not None:
        start, phase = ring[:n].long(), (pos[:n].long() - ring[:n].long()) & (PHASES - 1)
        for name, stride in (("ids", stride_ids), ("logits", stride_logits)):
            d[name] = torch.where((d[name] >= 0) & (start >= 0), d[name] + phase * stride, d[name])
    rows = ((d["ids"] >= 0) | (d["logits"] >= 0)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    s = x[rows].float() + (b[rows].float() if b is not None else 0)
    normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    h = (normed.float() * norm_weight.float()).to(weight.dtype)
    top = (h.float() @ weight[:vocab].float().T).topk(ids.shape[1], dim=-1)
    for out, name, value in ((ids, "ids", top.indices.to(torch.int32)), (logits, "logits", top.values)):
        at = d[name][rows]
        keep = (at >= 0) & (at < out.shape[0])
        out[at[keep]] = value[keep]
