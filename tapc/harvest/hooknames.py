"""What a captured key is called elsewhere: the HF module, TransformerLens' hook, SAELens'
hook_name and sparsify's hookpoint, with what the values mean. Written into a harvest's
manifest so a trainer's config can be filled in without reading tapc's docs.

The TransformerLens names are those of its Llama-style blocks; a point with no TransformerLens
counterpart (a fused vLLM projection, a `.source` op) gets None there, never a guess.
"""
from __future__ import annotations

import re

from tapc.plan.tapplan import PlannedTap

# (module suffix inside layer L, site, element) -> (TransformerLens hook under blocks.L, meaning)
_LAYER_POINTS = {
    ("", "resid", None): ("hook_resid_post", "the residual stream after decoder layer {L} "
                                              "(HF output_hidden_states[{L1}], the output of HF module {module})"),
    ("", "input", None): ("hook_resid_pre", "the residual stream entering decoder layer {L} (HF hidden_states[{L}])"),
    ("mlp", "output", None): ("hook_mlp_out", "the MLP's output of layer {L}, before it is added to the residual"),
    ("mlp.down_proj", "input", None): ("mlp.hook_post", "the MLP's hidden activations of layer {L} (act_fn(gate) * up)"),
    ("mlp.act_fn", "output", None): ("mlp.hook_post", "the MLP's hidden activations of layer {L} (act_fn(gate) * up)"),
    ("self_attn", "output", None): ("hook_attn_out", "the attention output of layer {L}, before it is added to the residual"),
    ("self_attn.o_proj", "input", None): ("attn.hook_z", "the attention heads' outputs of layer {L}, concatenated "
                                                        "(o_proj's input)"),
    ("input_layernorm", "output", 0): ("ln1.hook_normalized", "the normed input of layer {L}'s attention"),
    ("post_attention_layernorm", "output", 0): ("ln2.hook_normalized", "the normed input of layer {L}'s MLP"),
}
_LAYER = re.compile(r"^(?P<stack>.*\.layers)\.(?P<L>\d+)(?:\.(?P<rest>.+))?$")


def describe(tap: PlannedTap) -> dict:
    """Names and meaning of one captured point (see the module doc)."""
    p = tap.point
    m = _LAYER.match(p.module)
    tl, meaning = None, None
    if m is not None:
        layer = int(m["L"])
        hit = _LAYER_POINTS.get((m["rest"] or "", p.site, p.element))
        if hit is not None:
            tl = f"blocks.{layer}.{hit[0]}"
            meaning = hit[1].format(L=layer, L1=layer + 1, module=p.module)
    elif p.module.endswith("norm") and p.site == "output" and p.element in (None, 0):
        tl, meaning = "ln_final.hook_normalized", "the final norm's output (HF hidden_states[-1])"
    io = "input" if p.site == "input" else "output"
    if p.site == "resid":
        hf = {"module": p.module, "io": "output", "note": "the decoder layer's output hidden state"}
    elif p.site == "source":
        hf = None   # a call inside forward: no module of its own
    else:
        hf = {"module": p.module, "io": io, **({"element": p.element} if p.element is not None else {})}
    return {
        "tapc": tap.key,
        "hf_module": hf,
        "transformer_lens": tl,
        # SAELens (model_class_name="AutoModelForCausalLM") hooks a module's output by its name;
        # the arrow format names its column so.
        "saelens_hook_name": p.module if p.site == "resid" else tap.key,
        "sparsify_hookpoint": p.module.removeprefix("model.") if p.site == "resid" else None,
        "meaning": meaning or f"the {io} of {p.module}" + (f" ({p.site} {p.op}.{p.io})" if p.site == "source" else ""),
        "width": tap.width,
        "layer": tap.layer,
    }
