"""Sparse autoencoders in the graph: read an SAE's features and steer by them, per request, as
compiled functions (`point | call(name)`, docs/blocks.md).

    sae = tapc.sae.SAE.load("path/to/sae")                 # SAELens' folder: cfg.json, sae_weights.safetensors
    llm = tapc.VLLM(path, taps=["model.layers.12.resid | call(feats)", "model.layers.12.resid | call(steer)"],
                    functions={"feats": tapc.sae.features(sae, k=16), "steer": tapc.sae.clamp(sae)})
    llm.generate(prompts, params, taps=tapc.TapRequest(capture="*", params={"feature": 1234, "value": 8.0}))

`features(sae, k)` keeps each row's k largest feature activations (`ids`, int32, and `values`);
`clamp(sae)` sets feature `feature` to `value` for the rows of the requests that ask, by
adding `(value - f(x)) * W_dec[feature]`: the SAE's reconstruction moves by exactly that much,
its error term is left as it was. The SAE's weights are module state: graph inputs on the GPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tapc.errors import TapcError
from tapc.lang.functions import SIGNATURE, Signature

ARCHITECTURES = ("standard", "jumprelu")
WEIGHTS = "sae_weights.safetensors"


class SAE(torch.nn.Module):
    """An SAE's weights and encoder, as SAELens defines them: f(x) = act((x - b_dec') W_enc +
    b_enc), act ReLU ("standard") or JumpReLU with per-feature thresholds ("jumprelu"), b_dec'
    = b_dec where the config applies it to the input, else 0. Kept in float32."""

    def __init__(self, W_enc, b_enc, W_dec, b_dec, threshold=None, apply_b_dec_to_input: bool = True):
        super().__init__()
        self.W_enc, self.b_enc = torch.nn.Parameter(W_enc.float()), torch.nn.Parameter(b_enc.float())
        self.W_dec, self.b_dec = torch.nn.Parameter(W_dec.float()), torch.nn.Parameter(b_dec.float())
        self.threshold = None if threshold is None else torch.nn.Parameter(threshold.float())
        self.apply_b_dec_to_input = apply_b_dec_to_input

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @classmethod
    def load(cls, path: str | Path) -> "SAE":
        """An SAE saved by SAELens (`sae.save_model(path)`): cfg.json and sae_weights.safetensors."""
        from safetensors.torch import load_file

        path = Path(path)
        try:
            cfg = json.loads((path / "cfg.json").read_text())
            weights = load_file(path / WEIGHTS)
        except (OSError, ValueError) as e:
            raise TapcError(f"{path}: not an SAE folder in SAELens' format (cfg.json, {WEIGHTS}): {e}") from None
        arch = cfg.get("architecture", "standard")
        if arch not in ARCHITECTURES:
            raise TapcError(f"{path}: SAE architecture {arch!r}; tapc runs {', '.join(ARCHITECTURES)}")
        missing = [k for k in ("W_enc", "b_enc", "W_dec", "b_dec") + (("threshold",) if arch == "jumprelu" else ())
                   if k not in weights]
        if missing:
            raise TapcError(f"{path}/{WEIGHTS}: no tensor {missing[0]!r}")
        if cfg.get("normalize_activations", "none") != "none":
            raise TapcError(f"{path}: normalize_activations={cfg['normalize_activations']!r}; tapc runs SAEs "
                            "that read activations as they are ('none')")
        return cls(weights["W_enc"], weights["b_enc"], weights["W_dec"], weights["b_dec"], weights.get("threshold"),
                   bool(cfg.get("apply_b_dec_to_input", True)))

    def sae_in(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() - self.b_dec if self.apply_b_dec_to_input else x.float()

    def act(self, pre: torch.Tensor, threshold: torch.Tensor | None = None) -> torch.Tensor:
        if self.threshold is None:
            return torch.relu(pre)
        return torch.where(pre > threshold, pre, torch.zeros_like(pre))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Every feature's activation, [rows, d_sae], float32."""
        return self.act(self.sae_in(x) @ self.W_enc + self.b_enc, self.threshold)


class Features(torch.nn.Module):
    """Compiled function: each row's k largest feature activations, as results `ids` and `values`."""

    def __init__(self, sae: SAE, k: int):
        super().__init__()
        if not 1 <= k <= sae.d_sae:
            raise TapcError(f"features(): k={k}; give 1..{sae.d_sae} (the SAE's features)")
        self.sae, self.k = sae, k
        setattr(self, SIGNATURE, Signature(results=(("ids", k, "int32"), ("values", k, "float32"))))

    def forward(self, x, batch):
        top = self.sae.encode(x).topk(self.k, dim=-1)
        return {"ids": top.indices.to(torch.int32), "values": top.values}


class Clamp(torch.nn.Module):
    """Compiled function: feature `feature` set to `value` (per-request parameters), by adding
    (value - f_feature(x)) * W_dec[feature]; only that feature's encoder column is computed."""

    def __init__(self, sae: SAE):
        super().__init__()
        self.sae = sae
        setattr(self, SIGNATURE, Signature(params=(("feature", "scalar"), ("value", "scalar"))))

    def forward(self, x, batch):
        sae = self.sae
        i = batch.params["feature"].long().clamp(0, sae.d_sae - 1)
        pre = (sae.sae_in(x) * sae.W_enc.T[i]).sum(-1) + sae.b_enc[i]
        f = sae.act(pre, None if sae.threshold is None else sae.threshold[i])
        return (x.float() + (batch.params["value"] - f)[:, None] * sae.W_dec[i]).to(x.dtype)


def features(sae: SAE, k: int = 16) -> Features:
    return Features(sae, k)


def clamp(sae: SAE) -> Clamp:
    return Clamp(sae)
