"""bench_serve's greedy-token check, on the CPU: it must flag a token that is not the reference's
greedy choice, let a near tie pass, and count vanilla's answers the same way (the baseline it
prints beside tapc's). The load itself needs a GPU (benchmarks/bench_serve.py)."""
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_serve  # noqa: E402

VOCAB, PROMPT, MADE = 64, 10, 6


def logits(seed: int) -> torch.Tensor:
    """[MADE, VOCAB] float32 reference logits at realistic sizes, one clear top choice a row."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(MADE, VOCAB, generator=g) * 2
    rows[torch.arange(MADE), rows.argmax(-1)] += 6
    return rows


def test_the_greedy_tokens_pass_and_a_clear_miss_is_named():
    rows = logits(0)
    greedy = rows.argmax(-1).tolist()
    assert bench_serve.greedy_miss(rows, greedy) is None
    wrong = list(greedy)
    wrong[3] = int(rows[3].argmin())
    said = bench_serve.greedy_miss(rows, wrong)
    assert said is not None and said.startswith("generated token 3 is not the greedy choice")


def test_a_near_tie_is_not_a_miss():
    rows = logits(1)
    greedy = rows.argmax(-1).tolist()
    runner_up = int(rows[2].topk(2).indices[1])
    rows[2, runner_up] = rows[2, greedy[2]] - 1e-3    # within one bf16 step of the top
    tied = list(greedy)
    tied[2] = runner_up
    assert bench_serve.greedy_miss(rows, tied) is None


class Reference:
    """Stands in for HF: each sequence's logits, its prompt rows random, then `rows[seed]`."""

    def __init__(self, rows: dict):
        self.rows = rows
        self.asked = []

    def run(self, seqs):
        self.asked += seqs
        return [({}, torch.cat([torch.randn(len(tokens) - MADE, VOCAB), self.rows[tokens[0]]]))
                for tokens, _, _ in seqs]


def answer(seed: int, kind: str, tokens: list[int], aborted: bool = False):
    job = SimpleNamespace(kind=kind, prompt=[seed] + [7] * (PROMPT - 1), max_tokens=MADE)
    return SimpleNamespace(job=job, tokens=tokens, error=None, aborted=aborted)


def test_vanilla_answers_are_counted_on_the_requests_that_steer_nothing():
    rows = {s: logits(s) for s in range(5)}
    greedy = {s: rows[s].argmax(-1).tolist() for s in rows}
    missed = list(greedy[1])
    missed[0] = int(rows[1][0].argmin())
    done = [
        answer(0, "untapped", greedy[0]),
        answer(1, "capture", missed),                       # counted, a miss
        answer(2, "steer", missed),                         # vanilla steers nothing: not checked
        answer(3, "untapped", missed, aborted=True),        # cut short: not checked
        answer(4, "untapped", greedy[4][:-1]),              # short of max_tokens: not checked
    ]
    ref = Reference(rows)
    assert bench_serve.vanilla_misses(ref, done) == (1, 2)
    # teacher-forced on what each answer went through, unsteered and without captures
    assert [(s[0][0], s[1], s[2]) for s in ref.asked] == [(0, -1, False), (1, -1, False)]
    assert all(len(s[0]) == PROMPT + MADE - 1 for s in ref.asked)
