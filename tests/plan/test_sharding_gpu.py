"""tapc.plan.sharding against vanilla vLLM 0.26 on two GPUs: each rank's local tensors, read with
forward hooks in the workers (eager), placed with the map's runs, equal the same points at
tensor_parallel_size=1 on the same weights; pipeline stages hold the layers the map says."""
import os
import sys

import pytest
import torch
from gpu_engines import SMALL, engine_args, shutdown
from hf_checks import assert_matches, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

# Functions below are sent to vLLM's workers by value (cloudpickle), which vLLM allows only so.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

L = "model.layers.1"
KEYS = [f"{L}.self_attn.qkv_proj.output", f"{L}.self_attn.attn.output", f"{L}.self_attn.o_proj.input",
        f"{L}.self_attn.o_proj.output", f"{L}.mlp.gate_up_proj.output", f"{L}.mlp.act_fn.output",
        f"{L}.mlp.down_proj.input", f"{L}.resid"]
QWEN3_KEYS = [f"{L}.self_attn.q_norm.output", f"{L}.self_attn.k_norm.output"]


def write_checkpoint(path, arch: str, **override) -> str:
    import transformers

    torch.manual_seed(0)
    small = {**SMALL, **override}
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small, head_dim=32))
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _install_hooks(worker, keys):
    """In a worker: record the first call's tensor at each key (float32, on the CPU)."""
    from tapc.plan.sharding import parse_key

    model = worker.model_runner.get_model()
    worker._tapc_seen = seen = {}

    def keep(key, t):
        if key not in seen:
            seen[key] = t.detach().float().reshape(t.shape[0], -1).cpu().tolist()   # lists: vLLM's RPC reply carries no ndarray

    for key in keys:
        p = parse_key(key)
        mod = model.get_submodule(p.module)
        if p.site == "input":
            mod.register_forward_pre_hook(lambda m, a, key=key: keep(key, a[0]))
        elif p.site == "resid":
            mod.register_forward_hook(lambda m, a, o, key=key: keep(key, o[0] + o[1]))
        else:
            mod.register_forward_hook(lambda m, a, o, key=key: keep(key, o[0] if isinstance(o, tuple) else o))


def _take(worker):
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), worker._tapc_seen


def _layer_range(worker):
    inner = worker.model_runner.get_model().model
    return inner.start_layer, inner.end_layer


def _run(path, tokens, keys, tp):
    """{key: [local tensor of tp rank 0, 1, ...]} at the prompt's prefill."""
    import cloudpickle
    from vllm import LLM, SamplingParams

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    llm = LLM(path, tensor_parallel_size=tp, enforce_eager=True, **engine_args())
    llm.collective_rpc(_install_hooks, args=(keys,))
    llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    got = dict(llm.collective_rpc(_take))
    shutdown(llm)   # its GPU memory back before the next engine profiles its own
    return {k: [torch.tensor(got[r][k][:len(tokens)]) for r in range(tp)] for k in keys}


@pytest.mark.parametrize("arch,kv", [("llama", 4), ("llama", 1), ("qwen3", 4)])
def test_tp2_shards_placed_by_the_map_equal_tp1(tmp_path, arch, kv):
    from tapc.plan.sharding import ModelDims, shard_points
    from tapc.plan.tree import load_tree

    path = write_checkpoint(tmp_path / arch, arch, num_key_value_heads=kv)
    keys = KEYS + (QWEN3_KEYS if arch == "qwen3" else [])
    tokens = prompts()[0]["prompt_token_ids"] + prompts()[1]["prompt_token_ids"]
    one = _run(path, tokens, keys, tp=1)
    two = _run(path, tokens, keys, tp=2)
    shards = shard_points(load_tree(path), keys, ModelDims.of_model(path), tp=2)
    for key in keys:
        shard, locals_ = shards[key], two[key]
        host = torch.full((len(tokens), shard.width), float("nan"))
        for part, local in zip(shard.ranks, locals_):
            assert local.shape[1] == part.local_width, f"{key} rank {part.rank}: {local.shape[1]} columns"
            for dst, src, n in part.writes:
                host[:, dst:dst + n] = local[:, src:src + n]
        assert_matches(host, one[key][0], f"{key} ({shard.layout}) at tp=2")


@pytest.mark.parametrize("partition", [None, "1,3"])
def test_pp2_stages_hold_the_layers_the_map_says(tmp_path, monkeypatch, partition):
    from vllm import LLM

    from tapc.plan.sharding import pp_stages

    if partition:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    else:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    path = write_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(path, pipeline_parallel_size=2, enforce_eager=True, **engine_args())
    ranges = [tuple(r) for r in llm.collective_rpc(_layer_range)]
    shutdown(llm)
    want = list(pp_stages(SMALL["num_hidden_layers"], 2))
    assert ranges == want, f"stages hold layers {ranges}, the map says {want}"
