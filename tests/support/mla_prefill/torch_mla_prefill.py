"""A plain torch MLA prefill backend for vLLM 0.26, for the GPU test machine (tests/plan/test_mla_gpu.py).

vLLM 0.26 computes MLA attention's prefill (DeepSeek-V2/V3) with FlashAttention on Hopper, its
only MLA prefill backend there, and the GPU bundle carries no FlashAttention binaries. This folder
is a vLLM general plugin (the `.dist-info` beside this file names `register` under
`vllm.general_plugins`): vLLM runs `register` in each of its processes that finds the folder on
its path, the engine core included, before it builds the model (test_mla_gpu.py puts the folder
on the engine's PYTHONPATH while it starts). `register` puts this backend in FlashAttention's
place; decode runs vLLM's own `TRITON_MLA`. Not for speed: a loop over sequences, float32 scores.

vLLM's MLA attention hands a prefill backend per-head q, k and v of the step's prefill tokens
(`run_prefill_new_tokens`: the new tokens attend to themselves, causally) and, under chunked
prefill, of each chunk of the cached context (`run_prefill_context_chunk`: no mask); it merges
the parts with their log-sum-exps, `[heads, tokens]` in float32, as FlashAttention returns them.
"""
import torch
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int],
                     scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each sequence's queries `q[cu_q[i]:cu_q[i+1]]` over its keys `k[cu_k[i]:cu_k[i+1]]`
    (`[tokens, heads, dim]`; causal: query j sees the keys up to its own place, the sequences'
    ends aligned). Returns the output `[tokens, heads, v_dim]` in q's dtype and the log-sum-exp
    `[heads, tokens]` in float32 (-inf, and a zero output, for a query with no key)."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if qb == qa or kb == ka:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[qa:qb].float(), k[ka:kb].float()) * scale
        if causal:
            tq, tk = qb - qa, kb - ka
            seen = torch.arange(tk, device=q.device)[None, :] <= torch.arange(tq, device=q.device)[:, None] + (tk - tq)
            scores = scores.masked_fill(~seen, float("-inf"))
        lse[:, qa:qb] = torch.logsumexp(scores, dim=-1)
        out[qa:qb] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v[ka:kb].float()).to(q.dtype)
    return out, lse


class TorchMLAPrefill(MLAPrefillBackend):
    @staticmethod
    def get_name() -> str:
        return "TORCH_MLA_PREFILL"

    @classmethod
    def supports_mla_dimensions(cls, mla_dimensions) -> bool:
        return True

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse, out=None, output_scale=None):
        if output_scale is not None:
            raise NotImplementedError("fp8 output is not supported by the test's torch MLA prefill")
        cu = self._prefill_metadata.query_start_loc.tolist()
        got, lse = varlen_attention(q, k, v, cu, cu, self.scale, causal=True)
        if out is not None:
            out.copy_(got)
            got = out
        return (got, lse) if return_softmax_lse else got

    def run_prefill_context_chunk(self, chunk_idx, q, k, v):
        context = self._prefill_metadata.chunked_context
        return varlen_attention(q, k, v, self._prefill_metadata.query_start_loc.tolist(),
                                context.cu_seq_lens[chunk_idx].tolist(), self.scale, causal=False)


def register() -> None:
    """vLLM's general-plugin hook: this backend as the `FLASH_ATTN` MLA prefill backend. Checked
    here, so that a failure is this plugin's error in the engine's log, not vLLM's "no valid
    backend" later."""
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum, register_mla_prefill_backend

    register_mla_prefill_backend(MLAPrefillBackendEnum.FLASH_ATTN, f"{__name__}.TorchMLAPrefill")
    assert MLAPrefillBackendEnum.FLASH_ATTN.get_class() is TorchMLAPrefill
