"""The cookbook (examples/) on the CPU: what of each example runs without a GPU. Each example's
taps are explained against its own small model (`tapc explain`, as a user would check them
first); the served example's command is what vLLM's parser reads; the SAE example's training
(SAELens) runs on an arrow harvest of the toy engine; the LoRA example's adapter is what vLLM's
loader reads; each of the patching example's requests patches one site. Running them is the GPU's
(tests/project/test_examples_gpu.py)."""
import importlib.util
import py_compile
import shlex

import pytest
import torch
from places import EXAMPLES, SCRIPTS
from small_models import ENGINE, write_checkpoint   # examples/ is on sys.path: tests/support/gpu_engines.py

from tapc.api.requests import TapRequest, check
from tapc.cli import main
from tapc.plan.planner import build_plan
from tapc.wire.config import EngineConfig

ARCHS = {"moe-routing": "qwen3_moe"}   # the others run on the small Llama
READS = {   # what each example reads from its requests' captures
    "sae": lambda ex: [ex.KEY], "steer-served": lambda ex: [ex.KEY], "probe": lambda ex: [ex.KEY],
    "patching": lambda ex: ex.SITES + ["logits"],
    "moe-routing": lambda ex: [f"model.layers.{i}.mlp.experts.router.output[1]" for i in range(ex.LAYERS)],
    "lora": lambda ex: [f"{ex.QKV}.input", f"{ex.QKV}.output", f"{ex.DOWN}.input", f"{ex.DOWN}.output"],
    "lens": lambda ex: [f"model.layers.{i}.resid:lens.{r}" for i in range(ex.LAYERS) for r in ("ids", "logits")]
    + ["logits"],
    "induction": lambda ex: [f"model.layers.{i}.self_attn.pattern" for i in range(ex.LAYERS)]}


def load(name: str):
    """An example's script as a module (its `main` is not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name.replace('-', '_')}", EXAMPLES / SCRIPTS[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> a small checkpoint of it, as the examples write (weights and config)."""
    made = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = write_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return made[arch]

    return get


def test_every_example_folder_has_its_script_and_a_readme_that_runs_it():
    folders = {p.name for p in EXAMPLES.iterdir() if p.is_dir() and (p / "README.md").exists()}
    assert folders == set(SCRIPTS)
    for name, script in SCRIPTS.items():
        py_compile.compile(str(EXAMPLES / script), doraise=True)
        assert f"python examples/{script}" in (EXAMPLES / name / "README.md").read_text(), name


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_the_examples_taps_are_explained_against_its_model(name, models, capsys, tmp_path):
    ex = load(name)
    model = models(ARCHS.get(name, "llama"))
    engine = getattr(ex, "ENGINE", {})
    if engine:   # engine arguments that change the module tree (LoRA) come with a spec
        spec = tmp_path / "spec.yaml"
        spec.write_text(f"model: {model}\nengine: {engine}\ntaps:\n" + "".join(f"  - {t!r}\n" for t in ex.TAPS))
        assert main(["explain", str(spec)]) == 0
    else:
        assert main(["explain", model, *ex.TAPS]) == 0
    assert "tapc plan" in capsys.readouterr().out
    plan = build_plan(model, ex.TAPS, max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
                      max_num_seqs=ENGINE["max_num_seqs"], engine_args=dict(engine))
    reads = {t.key for t in plan.taps if t.action == "capture"}
    assert set(READS[name](ex)) <= reads, f"{name} reads {READS[name](ex)}; the plan captures {sorted(reads)}"


@pytest.fixture
def cpu_platform(monkeypatch):
    """vLLM's parser reads config defaults that need a platform; this machine may have no GPU."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(vllm.platforms, "_current_platform", CpuPlatform())


def test_the_served_examples_command_is_what_vllms_parser_reads(models, capsys, cpu_platform, monkeypatch):
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setenv("TAPC_ATTENTION_BACKEND", "TRITON_ATTN")
    ex = load("steer-served")
    command = ex.server_command(models("llama"), 8123)
    assert command[1:4] == ["-m", "tapc.cli", "serve"]
    assert main([*command[3:], "--print"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    assert args.port == 8123 and args.served_model_name == [ex.NAME] and args.attention_backend == "TRITON_ATTN"
    assert (args.max_model_len, args.max_num_seqs, args.kv_cache_memory_bytes) == \
        (ENGINE["max_model_len"], ENGINE["max_num_seqs"], ENGINE["kv_cache_memory_bytes"])
    assert "steer" in EngineConfig.read(args.additional_config).plan


def test_the_sae_examples_training_halves_the_error_on_an_arrow_harvest(tmp_path):
    pytest.importorskip("sae_lens", reason="sae-lens is not installed (pip install 'tapc[sae]')")
    from toy_harvests import arrow_harvest

    manifest, _ = arrow_harvest(tmp_path, n=100)   # the toy engine's, in tmp_path / "acts"
    _, before, after = load("sae").train_sae(tmp_path / "acts", manifest, key="model.layers.2.resid", steps=150,
                                             batch=32)
    assert after[0] < 0.5 * before[0], (before, after)


def test_the_lora_examples_adapter_is_what_vllm_reads(models, tmp_path, monkeypatch):
    import vllm.lora.lora_model as lora_model
    from vllm.lora.peft_helper import PEFTHelper

    monkeypatch.setattr(lora_model, "PIN_MEMORY", False)   # pinning needs a GPU driver
    ex = load("lora")
    base = models("llama")
    tensors = ex.write_adapter(base, tmp_path / "adapter")
    helper = PEFTHelper.from_local_dir(str(tmp_path / "adapter"), None)
    assert (helper.r, helper.vllm_lora_scaling_factor) == (ex.RANK, ex.ALPHA / ex.RANK)
    llama = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    lora = lora_model.LoRAModel.from_local_checkpoint(str(tmp_path / "adapter"), llama, helper, lora_model_id=1,
                                                      device="cpu", dtype=torch.bfloat16)
    assert set(lora.loras) == {f"model.layers.{i}.{parent}.{module}" for i in range(ex.LAYERS)
                               for module, parent in ex.TARGETS.items()}
    name = f"model.layers.{ex.LAYER}.mlp.down_proj"
    assert torch.equal(lora.loras[name].lora_b, tensors[f"base_model.model.{name}.lora_B.weight"])


def test_the_patching_examples_requests_each_patch_one_site(models):
    """Each case binds the parameter of one site's `patch`: the request is patched there only."""
    ex = load("patching")
    plan = build_plan(models("llama"), ex.TAPS, max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
                      max_num_seqs=ENGINE["max_num_seqs"])
    width = plan.hidden_size
    for site in ex.SITES:
        ask = check(plan, TapRequest(capture="logits", params={ex.PARAM[site]: {"positions": [3],
                                                                               "rows": torch.ones(1, width)}}), "r")
        patched = [t.key for t in plan.taps if t.action == "patch" and all(a.param in ask.params
                                                                          for a in t.args if a.param)]
        assert patched == [site]
