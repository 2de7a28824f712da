"""The module tree is built for the engine arguments that change it, and cached by them."""

from places import CONFIGS
from tapc.installed import cache_dir
from tapc.plan.tree import load_tree, tree_args

LLAMA = str(CONFIGS / "llama")


def test_tree_args_pick_the_ones_that_change_the_tree():
    assert tree_args({"tensor_parallel_size": 2, "max_num_seqs": 8, "enable_lora": True}) == \
        {"enable_lora": True, "lora_target_modules": None}
    assert tree_args(None) == tree_args({"max_model_len": 99})


def test_lora_engines_get_their_own_tree_and_cache_entry(trees):
    plain = trees("llama")
    lora = load_tree(LLAMA, {"enable_lora": True, "max_num_seqs": 4})
    cached = set(cache_dir().glob("*.json"))
    assert lora != plain, "vLLM's LoRA wrappers are in the LoRA engine's tree (tests/plan/test_lora.py)"
    assert {n.path for n in lora.nodes} >= {n.path for n in plain.nodes if n.path.startswith("model.layers.0.")}
    # each from its own cache entry, whichever was built first; max_num_seqs plays no part
    assert load_tree(LLAMA, {"enable_lora": True}) == lora and load_tree(LLAMA) == plain
    assert set(cache_dir().glob("*.json")) == cached


def test_several_gpus_get_the_single_gpu_tree(trees):
    """Results come back in the single-GPU layout: the tree (its widths) is the TP=1 one."""
    assert load_tree(LLAMA, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}) == trees("llama")
