"""A harvest of a small model's residual stream with tapc, then a sparse autoencoder trained on
it with SAELens.

tapc packs a small text corpus into windows of 32 tokens as SAELens does, runs them through a
tapped engine and writes one layer's residual stream at every token to disk in the HF datasets
layout SAELens reads as cached activations. SAELens's `ActivationsStore` reads the folder and
its `SAETrainer` trains a standard SAE for a few hundred steps. Printed: the SAE's
reconstruction error and L0 on a batch of the harvest, before training and after.

    python examples/sae/sae.py                    # needs sae-lens: pip install 'tapc[sae]'
"""
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/, for small_models
from small_models import WORDS, engine_args, require_gpu, small_model, verdict  # noqa: E402

LAYER = 2
KEY = f"model.layers.{LAYER}.resid"
TAPS = [KEY]
CONTEXT = 32      # tokens a window, BOS first
DOCUMENTS = 400   # about 8,000 tokens: 250 windows
STEPS, BATCH = 400, 256
L1, LR = 0.3, 1e-3   # for activations of norm about 2, as this model's (not normalized)


def corpus(n: int, seed: int = 0) -> list[str]:
    """`n` documents of random words: text the small model's tokenizer knows."""
    rng = random.Random(seed)
    words = [w for w in WORDS if w.isalpha()]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) + " ." for _ in range(n)]


def harvest_residuals(model: str, folder: Path):
    """The residual stream after layer LAYER at every token of the packed corpus, to `folder`
    (arrow: SAELens's cached-activations layout). Returns the harvest's manifest."""
    from tapc import VLLM
    from tapc.harvest.corpus import pack
    from tapc.harvest.run import harvest

    llm = VLLM(model, taps=TAPS, **engine_args())
    windows = list(pack(corpus(DOCUMENTS), llm.llm.get_tokenizer(), context_size=CONTEXT))
    return harvest(llm, windows, folder, format="arrow", context_size=CONTEXT, positions="prompt", progress=False)


def measure(sae, x) -> tuple[float, float]:
    """(the fraction of x's variance the SAE leaves unexplained, its mean L0) on a batch x."""
    import torch

    with torch.no_grad():
        features = sae.encode(x)
        error = (sae.decode(features) - x).pow(2).sum(-1).mean()
        variance = (x - x.mean(0)).pow(2).sum(-1).mean()
        return float(error / variance), float((features > 0).float().sum(-1).mean())


def train_sae(folder: Path, manifest, key: str = KEY, steps: int = STEPS, batch: int = BATCH, device: str = "cpu"):
    """SAELens trains a standard SAE (4x wide) on the harvest of `key` in `folder`: returns the
    SAE and (unexplained variance, L0) on one batch of the harvest before and after training."""
    import torch
    from sae_lens import LoggingConfig, SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.activations_store import ActivationsStore

    hook = manifest.hooks[key]   # its SAELens hook name and width
    store = ActivationsStore(model=None, dataset=None, streaming=False, hook_name=hook["saelens_hook_name"],
                             hook_head_index=None, context_size=manifest.settings["context_size"], d_in=hook["width"],
                             n_batches_in_buffer=8, total_training_tokens=steps * batch, store_batch_size_prompts=16,
                             train_batch_size_tokens=batch, prepend_bos=False, normalize_activations="none",
                             device=torch.device(device), dtype="float32", cached_activations_path=str(folder))
    torch.manual_seed(0)
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=hook["width"], d_sae=4 * hook["width"],
                                                        l1_coefficient=L1, dtype="float32", device=device))
    held = next(store)
    before = measure(sae, held)
    trainer = SAETrainer(SAETrainerConfig(total_training_samples=steps * batch, train_batch_size_samples=batch,
                                          lr=LR, lr_end=LR, device=device, logger=LoggingConfig(log_to_wandb=False)),
                         sae, store)
    trainer.fit()
    return sae, before, measure(sae, held)


def main() -> int:
    require_gpu()
    import torch

    folder = Path(tempfile.mkdtemp(prefix="tapc-sae-")) / "acts"
    manifest = harvest_residuals(small_model("llama"), folder)
    if manifest.failed or not manifest.complete:
        raise SystemExit(f"the harvest is incomplete: {manifest.failed}")
    print(f"harvest: {manifest.rows} windows of {CONTEXT} tokens of {KEY} in {folder}")
    _, before, after = train_sae(folder, manifest, device="cuda" if torch.cuda.is_available() else "cpu")
    print(f"SAE on {KEY}, {STEPS} steps of {BATCH} tokens:")
    print(f"  unexplained variance {before[0]:.4f} -> {after[0]:.4f}")
    print(f"  L0 {before[1]:.1f} -> {after[1]:.1f}")
    wrong = [] if after[0] < 0.5 * before[0] else ["training did not halve the reconstruction error"]
    return verdict(wrong, "SAELens's training on the harvest halved the reconstruction error")


if __name__ == "__main__":
    sys.exit(main())
