"""A linear probe on live traffic: each request's residual stream at its last prompt position,
captured as it runs, scored by a probe written in torch as the request finishes.

Requests of two kinds (about nature, about people) run through `AsyncVLLM`, vLLM's async
engine for servers, arriving a few milliseconds apart and overlapping. The first batch trains
a logistic-regression probe on their captures; then new traffic arrives and every request is
scored as it completes. The same scores are computed from HF transformers' own residual stream
on each request's tokens as the reference.

    python examples/probe/probe.py

Over HTTP, a `tapc serve` client asks the same with
`tc.ask(capture=[KEY], positions="last", inline=True)` (docs/serving.md).
"""
import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/, for small_models
from small_models import engine_args, require_gpu, small_model, verdict  # noqa: E402

LAYER = 2
KEY = f"model.layers.{LAYER}.resid"
TAPS = [KEY]
NATURE = "sun moon star rain snow wind fire sea river mountain tree flower garden water cold hot light dark".split()
PEOPLE = "mother father sister brother child friend king queen teacher doctor man woman people mary john anna".split()
FILLER = "the a and of to in on with was is".split()
TRAIN, LIVE = 96, 48   # requests
# vLLM's bf16 against HF's float32: the rows' relative error, the probe logits' error in their spread
ROWS_TOLERANCE, TOLERANCE = 0.03, 0.1


def traffic(n: int, seed: int) -> list[tuple[str, int]]:
    """`n` prompts with their labels: 1 about nature, 0 about people."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = i % 2
        pool = NATURE if label else PEOPLE
        words = [rng.choice(pool) if rng.random() < 0.6 else rng.choice(FILLER) for _ in range(rng.randint(6, 20))]
        out.append((" ".join(words), label))
    return out


class Probe:
    """Logistic regression on standardized rows, trained with torch."""

    def __init__(self, rows, labels, steps: int = 300):
        import torch

        torch.manual_seed(0)
        self.mean, self.std = rows.mean(0), rows.std(0) + 1e-6
        self.linear = torch.nn.Linear(rows.shape[1], 1)
        opt = torch.optim.Adam(self.linear.parameters(), lr=1e-2)
        for _ in range(steps):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(self.logit(rows), labels.float())
            opt.zero_grad()
            loss.backward()
            opt.step()

    def logit(self, rows):
        return self.linear((rows.float() - self.mean) / self.std)[:, 0]

    def __call__(self, rows):
        import torch

        with torch.no_grad():
            return torch.sigmoid(self.logit(rows))


async def serve(engine, name: str, items, on_done=None, gap: float = 0.005):
    """Each prompt sent `gap` seconds after the last, all in flight together; (prompt token ids,
    last-position row) per request, in order. `on_done(i, ids, row)` runs as each one finishes."""
    from vllm import SamplingParams

    from tapc import TapRequest

    ask = TapRequest(capture=KEY, positions="last")   # the row of the last prompt token
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def one(i, text):
        await asyncio.sleep(i * gap)
        async for out in engine.generate(text, params, f"{name}-{i}", taps=ask):
            pass
        if out.error is not None:
            raise RuntimeError(f"request {i}: {out.error}")
        row = out.taps[KEY][0].float()   # a copy: the capture's shared memory goes back
        if on_done is not None:
            on_done(i, out.prompt_token_ids, row)
        return list(out.prompt_token_ids), row

    return await asyncio.gather(*(one(i, text) for i, (text, _) in enumerate(items)))


def reference_rows(model: str, prompts: list[list[int]]):
    """HF transformers' residual stream after layer LAYER at each prompt's last token, float32."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        # hidden_states[0] is the embeddings, [i + 1] the output of layer i
        return torch.stack([hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[LAYER + 1][0, -1]
                            for ids in prompts])


async def run(model: str) -> int:
    import torch

    from tapc import AsyncVLLM

    engine = AsyncVLLM(model, taps=TAPS, **engine_args())
    try:
        train = traffic(TRAIN, seed=0)
        rows = torch.stack([row for _, row in await serve(engine, "train", train)])
        probe = Probe(rows, torch.tensor([label for _, label in train]))

        live = traffic(LIVE, seed=1)
        print(f"live traffic: {LIVE} requests, each scored as it finishes (P(nature) from {KEY}):")

        def score(i, ids, row):
            print(f"  request {i:2d} ({'nature' if live[i][1] else 'people'}): {float(probe(row[None])[0]):.3f}")

        served = await serve(engine, "live", live, on_done=score)
    finally:
        await engine.aclose()

    rows = torch.stack([row for _, row in served])
    reference = reference_rows(model, [ids for ids, _ in served])
    labels = torch.tensor([label for _, label in live])
    accuracy = float(((probe(rows) > 0.5).long() == labels).float().mean())
    with torch.no_grad():
        logits, expected = probe.logit(rows), probe.logit(reference)
    worst = float((logits - expected).abs().max() / expected.std())
    error = float((rows - reference).norm() / reference.norm())
    print(f"accuracy on live traffic: {accuracy:.3f}")
    print(f"against HF transformers on the same tokens: rows {error:.4f} apart (relative), probe logits at most "
          f"{worst:.4f} of their spread")
    wrong = []
    if error > ROWS_TOLERANCE or worst > TOLERANCE:
        wrong.append("the live rows or scores are off HF's")
    if accuracy < 0.85:
        wrong.append(f"the probe tells the two kinds apart in {accuracy:.0%} of requests only")
    return verdict(wrong, "the live rows and scores are the reference's, and the probe tells the two kinds apart")


def main() -> int:
    require_gpu()
    return asyncio.run(run(small_model("llama")))


if __name__ == "__main__":
    sys.exit(main())
