"""MLA prefill without FlashAttention, for the GPU test machine (tests/test_mla_gpu.py).

vLLM 0.26 computes MLA attention's prefill (DeepSeek-V2/V3) with FlashAttention on Hopper, its
only MLA prefill backend there, and the GPU bundle carries no FlashAttention binaries. Python
imports this module at start in every process whose PYTHONPATH holds this folder, vLLM's
spawned engine core included (test_mla_gpu.py puts it there): it registers a plain torch
backend (`torch_mla_prefill.TorchMLAPrefill`) as vLLM's `FLASH_ATTN` MLA prefill backend. Decode
runs vLLM's own `TRITON_MLA` backend. Not for speed: a loop over sequences, float32 scores.
"""
try:
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
except ImportError:   # a process without vLLM
    pass
else:
    register_mla_prefill_backend(MLAPrefillBackendEnum.FLASH_ATTN, "torch_mla_prefill.TorchMLAPrefill")
