"""Small random checkpoints with realistic init (std 0.02) and a tokenizer, written locally: the
examples and the GPU tests (tests/support/gpu_engines.py) run on them with no download.

    from small_models import small_model, engine_args
    path = small_model("llama")          # a temp folder: config.json, safetensors weights, tokenizer
    llm = VLLM(path, taps=[...], **engine_args())

The weights are random, so what a model says is nonsense; its activations have the scale of a
trained model's at init, so captures, edits and comparisons with HF transformers behave as they
would on a real checkpoint. Importing this module imports neither torch nor transformers.
"""
from __future__ import annotations

import itertools
import os
import sys
import tempfile

SMALL = dict(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4,
             num_hidden_layers=4, vocab_size=1024, max_position_embeddings=2048, rms_norm_eps=1e-5,
             initializer_range=0.02, tie_word_embeddings=False)
# The MoE checkpoints: SMALL's attention, experts 128 (Qwen3) / 256 wide.
MOE = dict(SMALL, intermediate_size=256)
# The MLA checkpoints: DeepSeek-V3's attention head sizes (a 512-wide kv latent, 64 rope dims) on
# 4 heads, every layer dense (first_k_dense_replace past the last).
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
           v_head_dim=128, first_k_dense_replace=SMALL["num_hidden_layers"], n_routed_experts=8, n_shared_experts=1,
           num_experts_per_tok=2, moe_intermediate_size=128)

# Words the examples' prompts are made of; the rest of the vocabulary is made-up words.
WORDS = """, . ? ! the a an and or but of to in on at for with from by as is are was were be been has have had
do does did not no yes this that these those it its he she they we you i his her their our my your who what
when where why how which there here then than so if because while after before about over under into out up
down all some any every each many much more most few other new old good bad big small long short high low
great little first last next same different own right left early late young happy sad hot cold red blue green
black white gold dark light mary john anna paul lisa mark sara tom emma david kate james went gave said made
took came saw knew thought told asked found felt left kept brought bought ran walked sat stood sang wrote read
played liked loved wanted needed tried called moved lived worked opened closed store house school city park
river road car train book letter drink food water bread apple cake cat dog bird horse fish tree flower garden
door window table chair bed room kitchen day night morning evening week year time world country king queen
friend mother father sister brother child children man woman people teacher doctor paris london rome tokyo
france england italy japan tower bridge museum church market village mountain sea sun moon star rain snow
wind fire one two three four five six seven eight nine ten hundred""".split()


def vocabulary(size: int) -> list[str]:
    """`size` distinct tokens: <unk>, <s>, </s> (ids 0, 1, 2, Llama's ids), WORDS, then made-up
    two-syllable words."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    made = (a + b for a, b in itertools.product(syllables, repeat=2))
    words = list(dict.fromkeys(["<unk>", "<s>", "</s>", *WORDS]))
    words += itertools.islice((w for w in made if w not in words), max(0, size - len(words)))
    return words[:size]


def write_tokenizer(path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocabulary(vocab_size)`: lower case, words and punctuation
    split apart, unknown words to <unk>, BOS in front of every text (as Llama's tokenizer adds it)."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    words = vocabulary(vocab_size)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)


def write_checkpoint(path, arch: str) -> str:
    """A random checkpoint of `arch` (below) in `path`, in bf16, seeded: the same weights every time."""
    import torch
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(**SMALL)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**SMALL, head_dim=32)
        model = transformers.Qwen3ForCausalLM(config)
    elif arch == "qwen3_moe":   # Qwen3-30B-A3B's routing (softmax top-k, renormalized), 8 experts, top 2
        config = transformers.Qwen3MoeConfig(**MOE, head_dim=32, moe_intermediate_size=128, num_experts=8,
                                             num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                             mlp_only_layers=[])
        model = transformers.Qwen3MoeForCausalLM(config)
    elif arch == "qwen2_moe":   # a shared expert beside the routed ones (its sigmoid gate too)
        config = transformers.Qwen2MoeConfig(**MOE, moe_intermediate_size=128, shared_expert_intermediate_size=256,
                                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                             decoder_sparse_step=1, mlp_only_layers=[])
        model = transformers.Qwen2MoeForCausalLM(config)
    elif arch == "mixtral":
        config = transformers.MixtralConfig(**MOE, num_local_experts=8, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    elif arch in ("deepseek_v2", "deepseek_v3"):   # MLA attention (DeepSeek's head sizes), dense MLPs
        v3 = arch == "deepseek_v3"
        kind = (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM) if v3 else \
            (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
        config = kind[0](**dict(SMALL, **MLA, q_lora_rank=192 if v3 else None))
        model = kind[1](config)
    else:
        raise ValueError(f"no small checkpoint for {arch!r}")
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


def small_model(arch: str = "llama", folder=None) -> str:
    """A random `arch` checkpoint with its tokenizer, in `folder` (default: a new temp folder)."""
    path = str(folder) if folder is not None else tempfile.mkdtemp(prefix=f"tapc-{arch}-")
    write_checkpoint(path, arch)
    write_tokenizer(path, SMALL["vocab_size"])
    return path


# vLLM settings for these small models: a short context, a few sequences at a time (fewer CUDA
# graphs to capture at start), and the KV cache given outright, which skips vLLM's memory
# profile: that reads the GPU's free memory, which other processes on the GPU change. vLLM still
# refuses to start while less than gpu_memory_utilization of the GPU is free: 0.1 leaves room for
# the other engines a GPU test run holds at once.
ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=1024, gpu_memory_utilization=0.1,
              kv_cache_memory_bytes=256 << 20, seed=0)


def engine_args(**more) -> dict:
    """ENGINE with `more`, and vLLM's attention backend from TAPC_ATTENTION_BACKEND where it is set
    (e.g. TRITON_ATTN, on a vLLM build without FlashAttention). Also has vLLM spawn its engine
    process rather than fork it: the engine's check for a GPU has touched the CUDA driver in this
    process by then, and a forked child cannot use it."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    backend = os.environ.get("TAPC_ATTENTION_BACKEND")
    return {**ENGINE, **({"attention_backend": backend} if backend else {}), **more}


def require_gpu() -> None:
    """Every example runs vLLM engines: where none can start (no CUDA GPU), say so in one line and
    exit, before anything is written (tests/project/test_examples.py checks what runs without one)."""
    from tapc.errors import EngineError
    from tapc.api.engine_args import require_cuda

    try:
        require_cuda()
    except EngineError as e:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: {e}") from None


def verdict(wrong: list[str], checked: str) -> int:
    """The example's exit status, said: 1 with what came out wrong, else 0 with what it checked."""
    if wrong:
        print("wrong: " + "; ".join(wrong))
        return 1
    print("checked: " + checked)
    return 0
