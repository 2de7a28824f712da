"""`lens` taps made captures: each becomes `<point>:lens.ids` (int32) and `<point>:lens.logits`
(float32), k columns each, which requests ask for like any capture.

The worker runs one kernel for the pair (tapc/kernels/lens.py), on the model's own final norm
and unembedding, so the model must have the standard ones: an RMSNorm at `model.norm` (HF's
LlamaRMSNorm; Gemma's `1 + weight` norm is another) and an `lm_head`. The point's rows must be
of the model's hidden width (the residual stream, or a module output of that width).
"""
from __future__ import annotations

import dataclasses

from tapc.errors import PlanError
from tapc.lang.edits import LENS
from tapc.plan.tapplan import READ, Arg, PlannedTap

NORM, HEAD = "model.norm", "lm_head"
NORMS = ("RMSNorm",)      # vLLM's layernorm.RMSNorm: HF's LlamaRMSNorm
RESULTS = (("ids", "int32"), ("logits", "float32"))
IDS, LOGITS = (f"{LENS}.{name}" for name, _ in RESULTS)   # their points' `result`
# Vocabulary entries one program of the kernel ranks: a row keeps k candidates per block
# until the second launch picks its k (tapc/kernels/lens.py).
VOCAB_BLOCK = 512


def complete_lens(taps: list[PlannedTap], tree, tp: int, pp: int) -> list[PlannedTap]:
    """`taps` with each `lens` tap replaced by its two captures."""
    out = []
    keys = {t.key for t in taps}
    for tap in taps:
        if tap.action != LENS:
            out.append(tap)
            continue
        _check(tap, tree, tp, pp)
        k = tap.args[0].value
        for name, dtype in RESULTS:
            point = dataclasses.replace(tap.point, result=f"{LENS}.{name}")
            if point.key in keys:
                raise PlanError(f"`{tap.source}`: {point.key} is also a compiled function's result; name the "
                                "function otherwise than `lens`")
            # k is the width; the vocabulary the kernel ranks travels with each capture
            out.append(PlannedTap(source=tap.source, point=point, action="capture", kind=READ, width=k, dtype=dtype,
                                  layer=tap.layer, args=(Arg("vocab", "count", value=tree.vocab_size),)))
    return out


def is_lens(tap: PlannedTap) -> bool:
    return tap.point.result is not None and tap.point.result.startswith(f"{LENS}.") and tap.function is None


def vocab_of(tap: PlannedTap) -> int:
    """The vocabulary a lens capture ranks (its k is its width)."""
    return next(a.value for a in tap.args if a.name == "vocab")


def candidates(vocab: int, k: int) -> int:
    """Candidate columns the kernel keeps a row: k for each block of the vocabulary."""
    return -(-vocab // VOCAB_BLOCK) * k


def scratch_columns(taps) -> int:
    """Candidate columns of the one scratch every lens of a GPU shares (they run one after
    another on its stream): the widest any of them needs; 0 without a lens."""
    return max((candidates(vocab_of(t), t.width) for t in taps if is_lens(t)), default=0)


def _check(tap: PlannedTap, tree, tp: int, pp: int) -> None:
    where = f"`{tap.source}`"
    if tp * pp > 1:
        raise PlanError(f"{where}: the logit lens runs on one GPU for now (this plan is for tensor_parallel_size="
                        f"{tp}, pipeline_parallel_size={pp})")
    if tap.width != tree.hidden_size:
        raise PlanError(f"{where}: the lens reads rows of the model's hidden width ({tree.hidden_size}); "
                        f"{tap.key} is {tap.width} wide")
    norm, head = tree.by_path.get(NORM), tree.by_path.get(HEAD)
    if head is None or norm is None or norm.cls not in NORMS:
        has = f"`{NORM}` is {norm.cls}" if norm is not None else f"no `{NORM}`"
        raise PlanError(f"{where}: the lens applies the model's final RMSNorm (`{NORM}`) and `{HEAD}`; "
                        f"{tree.architecture} has {has}{'' if head is not None else f' and no `{HEAD}`'}")
    if tap.args[0].value > tree.vocab_size:
        raise PlanError(f"{where}: k={tap.args[0].value} is more than the vocabulary ({tree.vocab_size})")
