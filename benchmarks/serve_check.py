"""bench_serve's check of the tapc server's answers, against HF transformers on the same weights
(teacher-forced on the tokens each request went through, with its own steering): every capture
has exactly the rows its positions promise and equals HF's within bf16 tolerance; every generated
token is HF's greedy choice unless HF's top two are within a near-tie margin (vLLM is not
batch-invariant). A wider model puts vLLM's bf16 logits further from the float32 reference's, on
vanilla's path as on tapc's, so a token within `NEAR` margins is a near miss: the same check runs
on vanilla's own answers to the requests that steer nothing, and tapc's near misses are a problem
only where they are more often than vanilla's; a farther miss is a problem on its own. `probe` is
the `--block` block; the tapc server imports it by path (`benchmarks.serve_check:probe`), so this
module imports nothing of benchmarks/ at its top."""
from __future__ import annotations

import base64
import fnmatch
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from serve_load import Done

STEER_LAYER, ALPHA = 1, 4.0
BLOCK_LAYER = 2   # --block: `probe` at this layer's residual stream, imported by the server by path


def probe(ctx, x):
    """The `--block` block (each worker imports it by path: `benchmarks.serve_check:probe`): every
    row's norm at its point, which the check compares with HF's."""
    ctx.save("norm", x.float().norm(dim=-1).cpu())


class Reference:
    """HF transformers on the checkpoint: residual stream per layer and logits, with steering.
    In float32 (the checkpoint's bf16 weights exactly): the served engine's bf16 rounding is
    then the only error a comparison sees, where a bf16 reference adds its own (four greedy
    tokens in 7,600 untapped requests of one run fell outside the near-tie margin against a
    bf16 reference, on vanilla vLLM's own path). Sequences run in batches (right-padded: causal
    attention keeps every real position's activations what they are alone, up to the batched
    kernels' rounding)."""

    # Padded tokens per batch at the default model (1024 wide, 8 layers); wider or deeper models
    # get fewer, in proportion: the hooks keep every layer's float32 rows of a batch on the GPU.
    TOKENS = 32768

    def __init__(self, path: str, vectors, device: str = "cuda"):
        import torch
        import transformers

        self.torch, self.device = torch, device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        config = self.model.config
        self.tokens = max(2048, self.TOKENS * 1024 * 8 // (config.hidden_size * config.num_hidden_layers))
        self.vectors = [torch.tensor(v, dtype=torch.float32, device=device) for v in vectors]

    def run(self, seqs: list[tuple[list[int], int, bool]]) -> list[tuple[dict, object]]:
        """For each (tokens, steering vector or -1, residual wanted): ({key: [tokens, hidden]
        float32 on the CPU} or {}, logits [tokens, vocab] float32 on the device)."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
        out: list = [None] * len(seqs)
        batch: list[int] = []
        for i in order:
            if batch and (len(batch) + 1) * len(seqs[i][0]) > self.tokens:
                self._batch([seqs[j] for j in batch], batch, out)
                batch = []
            batch.append(i)
        if batch:
            self._batch([seqs[j] for j in batch], batch, out)
        return out

    def _batch(self, seqs, where: list[int], out: list) -> None:
        torch = self.torch
        width = max(len(t) for t, _, _ in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        steer = torch.zeros((len(seqs), 1, self.model.config.hidden_size), dtype=torch.float32, device=self.device)
        for b, (tokens, vector, _) in enumerate(seqs):
            ids[b, :len(tokens)] = torch.tensor(tokens)
            if vector >= 0:
                steer[b, 0] = ALPHA * self.vectors[vector]
        layers: list = []

        def hook(i):
            def f(mod, args, out):
                h = out[0] if isinstance(out, tuple) else out
                layers.append(h)
                if i == STEER_LAYER:   # + 0 on the rows not steered
                    h = h + steer
                    return (h, *out[1:]) if isinstance(out, tuple) else h
            return f

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.model.model.layers)]
        try:
            with torch.no_grad():
                logits = self.model(ids.to(self.device)).logits.float()
        finally:
            for h in handles:
                h.remove()
        for b, (tokens, _, resid) in enumerate(seqs):
            n = len(tokens)
            seen = {f"model.layers.{i}.resid": h[b, :n].float().cpu() for i, h in enumerate(layers)} if resid else {}
            out[where[b]] = (seen, logits[b, :n])


# A token HF scores at most this many margins below its top choice is a near miss: bf16 drift,
# which grows with the model's width and depth (at 4096 wide, 8 layers, vanilla vllm serve's
# answers missed the margin by up to 2.2 margins as often as tapc serve's: 149 and 158 of 1,135).
# Near misses are counted on both servers and compared; a farther one is a problem on its own.
NEAR = 4.0


@dataclass
class Miss:
    text: str
    near: bool   # within NEAR margins of HF's top


def greedy_miss(rows, tokens: list[int]) -> Miss | None:
    """Whether `tokens` are greedy under the reference's logits `rows` ([tokens, vocab], the rows
    that chose them): each HF's top choice, but for near ties; the first one that is not, or None."""
    import torch

    top2 = rows.topk(2, dim=-1).values
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0]
    # Two bf16 steps at the logit's size: vLLM's bf16 logits are one step from the float32
    # reference's at a near tie (the GPU tests use the same margin against a bf16 HF).
    margin = 2e-2 * rows.abs().amax(dim=-1) + 1e-3
    gap = top2[:, 0] - chosen
    bad = (gap > margin) & ((top2[:, 0] - top2[:, 1]) > margin)
    if not bad.any():
        return None
    k = int(bad.nonzero()[0])
    far = bad & (gap > NEAR * margin)
    return Miss(f"generated token {k} is not the greedy choice (HF top {top2[k, 0]:.4f}, chosen {chosen[k]:.4f})",
                near=not bool(far.any()))


def more_often(k: int, n: int, j: int, m: int) -> bool:
    """Whether k near misses of n are more than j of m (the baseline) explains: a one-sided
    two-proportion test at three standard errors, plus one request."""
    if n == 0:
        return False
    p = (k + j) / (n + m)
    bound = j / m if m else 0.0
    return k / n > bound + 3 * math.sqrt(p * (1 - p) * (1 / n + (1 / m if m else 1.0))) + 1 / n


def vanilla_misses(ref: Reference, done: list[Done]) -> tuple[int, int, int]:
    """The greedy-token check on vanilla vllm serve's own answers (its unsteered requests: it
    steers none): (requests with a near miss, with a farther one, requests checked). The baseline
    for tapc's near misses: a wider or deeper model puts vLLM's bf16 logits further from the
    float32 reference's, on vanilla's path as on tapc's."""
    todo = [d for d in done if not (d.error or d.aborted) and "steer" not in d.job.kind
            and len(d.tokens) == d.job.max_tokens]
    refs = ref.run([((d.job.prompt + d.tokens)[:-1], -1, False) for d in todo])
    misses = [greedy_miss(logits[len(d.job.prompt) - 1:], d.tokens) for d, (_, logits) in zip(todo, refs)]
    near = sum(m is not None and m.near for m in misses)
    return near, sum(m is not None for m in misses) - near, len(todo)


def near_miss_problems(where: str, tapc: dict[str, tuple[int, int]], vanilla: tuple[int, int, int]) -> list[str]:
    """tapc's near misses ({"unsteered": (k, n), "steered": (k, n)}) against vanilla's answers to
    the requests that steer nothing (`vanilla_misses`): a problem where tapc's are more often."""
    j, _, m = vanilla
    return [f"{where}: {kind} requests' generated tokens miss the greedy margin more often on tapc serve ({k} of {n}) "
            f"than vanilla vllm serve's unsteered ones ({j} of {m})"
            for kind, (k, n) in tapc.items() if more_often(k, n, j, m)]


def check(ref: Reference, done: list[Done], block: bool = False,
          saved: list | None = None) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """Every finished tapc request against HF; the captures fetched from the server (`block`:
    and the norms the server's block saved). Saving requests: (their number, where, HF's rows,
    their tokens) go to `saved`, checked in the folder once the server has stopped. Returns the
    problems (a generated token far outside the greedy margin among them), and its near misses
    ({"unsteered": (near misses, checked), "steered": ...}), which `near_miss_problems` compares
    with vanilla's."""
    import torch
    from safetensors.torch import load

    from tapc.wire.positions import expected_rows, select

    problems, todo = [], []
    near = {"unsteered": [0, 0], "steered": [0, 0]}   # requests with a near miss, requests checked
    for d in done:
        job = d.job
        if d.error or d.aborted:
            continue
        if len(d.tokens) != job.max_tokens:
            problems.append(f"request {job.i}: {len(d.tokens)} tokens of {job.max_tokens}")
            continue
        todo.append(d)
    refs = ref.run([((d.job.prompt + d.tokens)[:-1], d.job.vector if "steer" in d.job.kind else -1,
                     "capture" in d.job.kind) for d in todo])
    for d, (seen, logits) in zip(todo, refs):
        job = d.job
        where = f"request {job.i} ({job.kind}, {job.positions}, stream={job.stream})"
        seq = job.prompt + d.tokens
        miss = greedy_miss(logits[len(job.prompt) - 1:], d.tokens)
        if miss and not miss.near:
            problems.append(f"{where}: {miss.text}")
        counts = near["steered" if "steer" in job.kind else "unsteered"]
        counts[0] += miss is not None and miss.near
        counts[1] += 1
        if "capture" not in job.kind:
            continue
        if job.save:
            if not (d.inline and "saved" in d.inline):
                problems.append(f"{where}: asked to save, the response carried {d.inline!r}")
            else:
                saved.append((d.inline["saved"], where, seen, seq[:-1]))
            continue
        if job.inline and not (d.inline and ("safetensors" in d.inline or "fetch" in d.inline)):
            problems.append(f"{where}: asked inline, the response carried {d.inline!r}")
            continue
        if d.taps is not None:
            taps = d.taps
        else:
            taps = load(base64.b64decode(d.inline["safetensors"]) if job.inline and "safetensors" in d.inline
                        else d.fetched)
        seen = {k: v for k, v in seen.items() if fnmatch.fnmatchcase(k, job.capture)}
        missing = sorted(set(seen) - set(taps))
        if missing:
            problems.append(f"{where}: its results lack {len(missing)} captures ({missing[0]}, ...)"
                            + (f"; their error: {d.result_error}" if d.result_error else ""))
        want = expected_rows(job.positions, len(job.prompt), len(d.tokens))
        pos = np.arange(len(seq) - 1)
        keep = torch.from_numpy(select(job.positions, pos, len(job.prompt)))
        norms = sorted((k for k in taps if k.startswith("saved/norm/")), key=lambda k: int(k.rsplit("/", 1)[1]))
        if block and job.positions == "all":   # the block sees every row; with positions "all" HF's are all here
            got = torch.cat([taps.pop(k) for k in norms]).float()
            hf = seen[f"model.layers.{BLOCK_LAYER}.resid"].norm(dim=-1).cpu()
            if got.shape != hf.shape or not torch.allclose(got, hf, rtol=3e-2, atol=1e-2):
                problems.append(f"{where}: the block's saved norms differ from HF's ({tuple(got.shape)} rows)")
        for k in norms:
            taps.pop(k, None)
        for key, got in taps.items():
            if got.shape[0] != want:
                problems.append(f"{where}: {key} has {got.shape[0]} rows, its positions promise {want}")
                continue
            problems += differs(where, key, got, seen[key][keep])
    return problems, {kind: tuple(c) for kind, c in near.items()}


def differs(where: str, key: str, got, hf) -> list[str]:
    """A problem if `got` is not HF's rows within bf16 tolerance."""
    import torch

    rel = ((got.float() - hf).norm() / hf.norm()).item()
    cos = torch.nn.functional.cosine_similarity(got.float(), hf, dim=1).min().item()
    if rel > 5e-2 or cos < 0.99:
        return [f"{where}: {key} differs from HF: relative error {rel:.4f}, worst cosine {cos:.4f}"]
    return []


def check_saved(folder: str, saved: list) -> list[str]:
    """The saved requests' rows in the stopped server's save folder: each request's number once,
    its token ids, every position, each key equal to HF's."""
    import torch

    from tapc.data import Shards
    from tapc.harvest.run import Manifest

    m = Manifest.read(folder)
    if not m.complete:
        return [f"{folder}: the manifest is not complete (the server did not stop cleanly)"]
    shards = Shards(folder)
    cols = {k: torch.cat([shards.load(k, i) for i in range(len(m.shards))]) if m.shards else torch.zeros(0)
            for k in (*m.keys, "request", "token_ids", "position")}
    problems = [f"{folder}: request {f['request']} failed: {f['error']}" for f in m.failed]
    for n, where, seen, tokens in saved:
        mine = cols["request"] == n
        if cols["token_ids"][mine].tolist() != tokens or cols["position"][mine].tolist() != list(range(len(tokens))):
            problems.append(f"{where}: saved as {n}, its rows' token ids or positions are not its own")
            continue
        for key in m.keys:
            problems += differs(f"{where} (saved as {n})", key, cols[key][mine], seen[key])
    return problems
