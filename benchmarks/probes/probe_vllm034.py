"""Whether the vLLM 0.34.0 bundle (benchmarks/calls/make-vllm034-bundle) runs on the GPU machine:
torch 2.14.0 and NCCL 2.30.7, a Triton kernel, torchvision's CUDA ops, then a plain vLLM engine
on a tiny Llama with dummy weights, vLLM's defaults (torch.compile, CUDA graphs, kernel warmup)
and TRITON_ATTN. From the project root, after the last part's recv.sh:

    source .gpu034/pK/env.sh && python3 benchmarks/probes/probe_vllm034.py

Every step prints a line starting with "[probe034]"; any failure exits non-zero.
"""
import json
import os
import sys
import tempfile
import time


def step(msg):
    print(f"[probe034] {msg}", flush=True)


def fail(msg):
    raise SystemExit(f"[probe034] FAIL {msg}")


def check_torch():
    import torch

    step(f"torch {torch.__version__} from {os.path.dirname(torch.__file__)}, CUDA {torch.version.cuda}")
    if not torch.cuda.is_available():
        fail("torch: CUDA not available")
    step(f"device {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
    step(f"NCCL {torch.cuda.nccl.version()}")
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if any(k in line for k in ("libnccl", "libcudart", "libcublas.so"))})
    step(f"loaded: {libs}")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    step(f"bf16 matmul ok ({(x @ x).float().sum().item():.3f})")
    try:
        step(f"cuDNN {torch.backends.cudnn.version()}")
    except RuntimeError as e:  # the image's cuDNN 9.19 is older than torch 2.14's 9.24; vLLM's dense path skips it
        step(f"cuDNN refused: {str(e)[:200]}")


def check_triton():
    import torch
    import triton
    import triton.language as tl

    step(f"triton {triton.__version__} from {os.path.dirname(triton.__file__)}")

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

    n = 10000
    a, b = torch.rand(n, device="cuda"), torch.rand(n, device="cuda")
    out = torch.empty_like(a)
    add[(triton.cdiv(n, 1024),)](a, b, out, n, BLOCK=1024)
    err = (out - (a + b)).abs().max().item()
    step(f"triton kernel ran, max error {err}")
    if err > 1e-6:
        fail("triton: wrong result")


def check_torchvision():
    import torch
    import torchvision
    from torchvision.ops import nms

    step(f"torchvision {torchvision.__version__} from {os.path.dirname(torchvision.__file__)}")
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30]], dtype=torch.float, device="cuda")
    keep = nms(boxes, torch.tensor([0.9, 0.8, 0.7], device="cuda"), 0.5).tolist()
    step(f"torchvision nms on the GPU kept {keep}")
    if keep != [0, 2]:
        fail("torchvision: wrong nms result")


def report_cute_dsl():
    """vLLM 0.34's kernel warmup imports its MiniMax-M3 kernels on CUDA, which import CuTe DSL
    (cutlass, quack, cuda.bindings); the bundle does not carry them, the image may."""
    import importlib

    for name in ("cutlass", "quack", "cuda.bindings"):
        try:
            mod = importlib.import_module(name)
            step(f"{name} {getattr(mod, '__version__', '?')} from {getattr(mod, '__file__', None)}")
        except ImportError as e:
            step(f"{name} not importable: {e}")


def tiny_llama(path):
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 256, "intermediate_size": 512, "initializer_range": 0.02,
        "max_position_embeddings": 2048, "num_attention_heads": 4, "num_hidden_layers": 4,
        "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 1000,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def check_vllm():
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import CompilationMode, CUDAGraphMode

    step(f"vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)}")
    with tempfile.TemporaryDirectory() as model:
        tiny_llama(model)
        t0 = time.time()
        llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, attention_backend="TRITON_ATTN",
                  gpu_memory_utilization=0.3, max_model_len=512, seed=0)
        step(f"engine started in {time.time() - t0:.1f} s")
        cc = llm.llm_engine.vllm_config.compilation_config
        step(f"compilation mode {cc.mode!r}, cudagraph mode {cc.cudagraph_mode!r}")
        if cc.mode != CompilationMode.VLLM_COMPILE or cc.cudagraph_mode == CUDAGraphMode.NONE:
            fail("vllm: the engine runs without compile or CUDA graphs")
        prompts = [{"prompt_token_ids": [1, 17, 42, 99, 5, 300 + i]} for i in range(4)]
        t0 = time.time()
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        step(f"generate took {time.time() - t0:.2f} s")
        for i, o in enumerate(outs):
            step(f"out[{i}]: {list(o.outputs[0].token_ids)}")
        if not all(len(o.outputs[0].token_ids) == 16 for o in outs):
            fail("vllm: wrong number of generated tokens")


def main():
    step(f"python {sys.version.split()[0]}")
    check_torch()
    check_triton()
    check_torchvision()
    report_cute_dsl()
    check_vllm()
    step("ALL OK")


if __name__ == "__main__":
    main()
