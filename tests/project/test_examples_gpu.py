"""The cookbook (examples/) on a GPU: each example runs as its own process, as a user runs it, and
must exit 0 and print what it exists to show. Its printed result is checked here again from its
output: the SAE's reconstruction error halved, steered completions unlike the plain ones with the
edit read back in the captures, probe scores equal to HF's, the exactly known patches, no banned
expert chosen, LoRA outputs equal to the layers' own weights with and without the adapter, the
last layer's lens equal to the model's own next-token logits.

Each example is an xdist group of its own, so that `--dist loadgroup` spreads them over the
workers. The SAE example needs sae-lens, the served one vLLM's serving packages (uvicorn): each
skips without them.
"""
import ast
import importlib.util
import re
import subprocess
import sys

import pytest
import torch
from gpu_engines import engine_env
from places import EXAMPLES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]



def example(name: str):
    return pytest.mark.xdist_group(f"example {name}")


def run(script: str) -> str:
    """The example's stdout, once it exited 0."""
    engine_env()   # the suite's engine settings, which the example's process inherits
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def numbers(pattern: str, text: str) -> list[tuple[float, ...]]:
    found = [tuple(float(g) for g in m.groups()) for m in re.finditer(pattern, text, re.M)]
    assert found, f"no line matches {pattern!r} in:\n{text}"
    return found


def needs(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: {why}")


@example("sae")
def test_sae_trains_on_a_tapc_harvest():
    needs("sae_lens", "the SAE example trains with SAELens (pip install 'tapc[sae]')")
    out = run("sae/sae.py")
    ((windows,),) = numbers(r"^harvest: (\d+) windows", out)
    assert windows > 100
    ((before, after),) = numbers(r"unexplained variance ([\d.]+) -> ([\d.]+)", out)
    assert after < 0.5 * before, out


@example("steer-served")
def test_a_served_model_is_steered_per_request():
    needs("uvicorn", "`tapc serve` runs vLLM's OpenAI server")
    out = run("steer-served/steer_served.py")
    plain = [ast.literal_eval(m) for m in re.findall(r"^  plain:   (.*)$", out, re.M)]
    steered = [ast.literal_eval(m) for m in re.findall(r"^  steered: (.*)$", out, re.M)]
    assert len(plain) == len(steered) == 3 and all(plain), out
    assert all(p != s for p, s in zip(plain, steered)), out
    errors = numbers(r"against [\d.]+ x the vector: ([\d.]+) apart", out)
    assert len(errors) == 3 and all(e < 0.02 for (e,) in errors), out


@example("probe")
def test_a_probe_scores_live_traffic_as_the_reference():
    out = run("probe/probe.py")
    assert len(re.findall(r"^  request +\d+ \((nature|people)\): [\d.]+$", out, re.M)) == 48, out
    ((accuracy,),) = numbers(r"^accuracy on live traffic: ([\d.]+)", out)
    ((rows, logits),) = numbers(r"rows ([\d.]+) apart \(relative\), probe logits at most ([\d.]+) of their spread", out)
    assert accuracy >= 0.85 and rows < 0.03 and logits < 0.1, out


@example("patching")
def test_patching_restores_the_clean_logit_difference_where_it_must():
    out = run("patching/patching.py")
    ((clean, corrupt),) = numbers(r"clean (-?[\d.]+), corrupted (-?[\d.]+)$", out)
    assert clean - corrupt > 0.05, out
    table = {m[0]: (float(m[1]), float(m[2]))
             for m in re.findall(r"^(embeddings|layer \d+) +(-?[\d.]+) +(-?[\d.]+)$", out, re.M)}
    assert list(table) == ["embeddings", "layer 0", "layer 1", "layer 2", "layer 3"], out
    # (the corrupted token's position, the last position): the embeddings and the last layer are exact
    assert table["embeddings"] == pytest.approx((1.0, 0.0), abs=0.05), out
    assert table["layer 3"] == pytest.approx((0.0, 1.0), abs=0.05), out


@example("moe-routing")
def test_expert_use_is_counted_and_a_banned_expert_never_chosen():
    out = run("moe-routing/moe_routing.py")
    rows = re.findall(r"^(\d+) +(\d+)  ((?: +\d+){8}) +(\d+)  ((?: +\d+){8})$", out, re.M)
    assert len(rows) == 4, out
    for _, tokens, before, banned, after in rows:
        before, after = [int(n) for n in before.split()], [int(n) for n in after.split()]
        assert sum(before) == sum(after) == int(tokens) * 2 * 4, out   # top-2 at each of 4 layers
        assert before[int(banned)] == max(before) > 0 and after[int(banned)] == 0, out


@example("lora")
def test_lora_captures_with_and_without_the_adapter():
    out = run("lora/lora.py")
    errors = numbers(r"relative error ([\d.]+)$", out)
    assert len(errors) == 4 and all(e < 0.02 for (e,) in errors), out
    ((qkv, down),) = numbers(r"adds to those outputs: \S+ ([\d.]+), \S+ ([\d.]+)", out)
    assert qkv > 0.1 and down > 0.1, out
    moved = numbers(r"^  layer \d: ([\d.]+)$", out)
    assert len(moved) == 4 and all(m > 0.01 for (m,) in moved), out


@example("lens")
def test_the_lens_of_the_last_layer_is_the_models_own_next_token():
    out = run("lens/lens.py")
    rows = re.findall(r"its rank in each layer's lens ((?:[-\d]+ ?){4}); first best at layer (\w+)$", out, re.M)
    assert len(rows) == 4, out
    assert "checked: the last layer's lens is the model's own next-token logits" in out, out


@example("induction")
def test_the_induction_scores_come_from_patterns_equal_to_hf():
    out = run("induction/induction.py")
    assert len(re.findall(r"^layer \d: induction score per head( [\d.]+){8}$", out, re.M)) == 4, out
    assert "checked: every row sums to 1 over its keys and equals HF's eager attention weights" in out, out
