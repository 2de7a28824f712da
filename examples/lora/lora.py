"""One prompt with and without a LoRA adapter, in one batch: what the adapter changes, layer by
layer, and its delta read off the captures.

The script writes a small Llama and a rank-8 LoRA adapter for it in PEFT's format
(adapter_config.json, adapter_model.safetensors: what `peft` saves) on q_proj, v_proj and
down_proj. vLLM wraps those layers for LoRA at load, and tapc taps the wrapped layers: their
`.output` is the adapted output for the request that carries the adapter and the base output
for the one that does not. The captured inputs and outputs of two wrapped layers are checked
against the layer's own weights: `x W^T` without the adapter, `x W^T + (alpha / r) x A^T B^T`
with it.

    python examples/lora/lora.py
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/, for small_models
from small_models import SMALL, engine_args, require_gpu, small_model, verdict  # noqa: E402

RANK, ALPHA = 8, 16
TARGETS = {"q_proj": "self_attn", "v_proj": "self_attn", "down_proj": "mlp"}   # module -> its parent
LAYER = 1   # where the wrapped layers' inputs and outputs are checked
LAYERS = SMALL["num_hidden_layers"]
QKV, DOWN = f"model.layers.{LAYER}.self_attn.qkv_proj", f"model.layers.{LAYER}.mlp.down_proj"
TAPS = ["model.layers.*.resid", f"{QKV}.input", f"{QKV}.output", f"{DOWN}.input", f"{DOWN}.output"]
ENGINE = dict(enable_lora=True, max_lora_rank=RANK, max_loras=1)
PROMPT = "When Mary and John went to the store, John gave a drink to"
TOLERANCE = 0.02   # relative error of bf16 matmuls against the float32 reference


def write_adapter(base: str, folder: Path, seed: int = 0) -> dict:
    """A random LoRA adapter for the checkpoint at `base` in PEFT's format; its tensors by name.
    A and B both random: peft starts B at zero, which would change nothing."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(base) / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    shapes = {"q_proj": (hidden, hidden), "v_proj": (hidden, kv), "down_proj": (inner, hidden)}   # (in, out)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for module, parent in TARGETS.items():
            fan_in, fan_out = shapes[module]
            name = f"base_model.model.model.layers.{i}.{parent}.{module}"
            a = torch.randn(RANK, fan_in, generator=g) / fan_in ** 0.5
            b = torch.randn(fan_out, RANK, generator=g) * 0.02
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a.bfloat16(), b.bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": RANK,
        "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": sorted(TARGETS), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "inference_mode": True}, indent=2))
    return tensors


def expected(weights: dict, adapter: dict | None, x) -> dict:
    """What QKV and DOWN must output for the inputs `x` (by key), in float32: the base layer,
    plus the adapter's (alpha / r) x A^T B^T where it has one (vLLM packs q, k, v in one layer)."""
    import torch

    def base(name):
        return weights[f"model.layers.{LAYER}.{name}.weight"].float()

    def delta(name, xs):
        if adapter is None:
            return 0.0
        a = adapter[f"base_model.model.model.layers.{LAYER}.{name}.lora_A.weight"].float()
        b = adapter[f"base_model.model.model.layers.{LAYER}.{name}.lora_B.weight"].float()
        return (ALPHA / RANK) * xs @ a.T @ b.T

    xq, xd = x[f"{QKV}.input"].float(), x[f"{DOWN}.input"].float()
    q = xq @ base("self_attn.q_proj").T + delta("self_attn.q_proj", xq)
    k = xq @ base("self_attn.k_proj").T
    v = xq @ base("self_attn.v_proj").T + delta("self_attn.v_proj", xq)
    return {f"{QKV}.output": torch.cat([q, k, v], dim=-1),
            f"{DOWN}.output": xd @ base("mlp.down_proj").T + delta("mlp.down_proj", xd)}


def relative(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> int:
    require_gpu()
    import tempfile

    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from tapc import VLLM, TapRequest

    base = small_model("llama")
    folder = Path(tempfile.mkdtemp(prefix="tapc-lora-"))
    adapter = write_adapter(base, folder)
    llm = VLLM(base, taps=TAPS, **engine_args(**ENGINE))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # one batch: the first request with the adapter, the second without
    tuned, plain = llm.generate([PROMPT, PROMPT], greedy, taps=TapRequest(capture="*", positions="prompt"),
                                lora_request=[LoRARequest("example", 1, str(folder)), None])
    for out in (tuned, plain):
        if out.error is not None:
            raise SystemExit(f"a request failed: {out.error}")
    print(f"with the adapter:    {tuned.outputs[0].text!r}")
    print(f"without the adapter: {plain.outputs[0].text!r}")
    print("the residual stream with the adapter against without (relative difference over the prompt):")
    for i in range(LAYERS):
        key = f"model.layers.{i}.resid"
        print(f"  layer {i}: {relative(tuned.taps[key], plain.taps[key]):.3f}")

    weights = load_file(str(Path(base) / "model.safetensors"))
    wrong = []
    print(f"layer {LAYER}'s wrapped layers, captured output against x W^T (+ (alpha / r) x A^T B^T):")
    for label, out, lora in (("with the adapter", tuned, adapter), ("without", plain, None)):
        want = expected(weights, lora, out.taps)
        for key, ref in want.items():
            error = relative(out.taps[key], ref)
            print(f"  {label:<17}{key:<42} relative error {error:.4f}")
            if error > TOLERANCE:
                wrong.append(f"{label}: {key} is {error:.4f} from its reference")
    moved = {key: relative(expected(weights, adapter, tuned.taps)[key], expected(weights, None, tuned.taps)[key])
             for key in (f"{QKV}.output", f"{DOWN}.output")}
    print("  what the adapter adds to those outputs: " + ", ".join(f"{k} {v:.3f}" for k, v in moved.items()))
    if min(moved.values()) < 5 * TOLERANCE:
        wrong.append(f"the adapter moves the outputs too little to be told apart: {moved}")
    return verdict(wrong, "each request's wrapped layers output the base layer, plus the adapter where it asked for it")


if __name__ == "__main__":
    sys.exit(main())
