"""vLLM's model for a config built on the meta device, with no GPU, and described as a `ModuleTree`.

Runs in a child process (`python -m tapc.plan.metamodel <model dir> <engine args>`, started by
`tree.load_tree`): vLLM's platform, distributed state and `torch.ops._C` are swapped for the
build. What is not a plain module's forward is found here: the modules inside vLLM's fused-MoE
op and the MoE routers, MLA attention's partly-called internals, LoRA wrappers' base layers.
"""
from __future__ import annotations

import contextlib
import json
import sys
import tempfile

from tapc.errors import ResolveError
from tapc.installed import vllm_version
from tapc.plan.forwards import Widths, norm_kind, source_ops
from tapc.plan.tree import ModuleTree, Node, tree_args


def build_tree(model_dir: str, engine_args: dict | None = None) -> ModuleTree:
    """Build vLLM's model for `model_dir` on the meta device and describe it. Needs no GPU.
    `engine_args`: those of TREE_ENGINE_ARGS the engine runs with."""
    import torch

    model = _meta_model(model_dir, tree_args(engine_args))
    hf = model.config if hasattr(model, "config") else None
    layers_path, layers = _find_layers(model)
    layer_of = {id(m): i for i, m in enumerate(layers)}
    hidden = int(getattr(hf, "hidden_size"))
    widths = Widths(hidden)
    in_op, unused = _moe_op_modules(model)
    unused |= _lora_base_layers(model)
    partial = _mla_internals(model)
    unused |= partial.keys()
    nodes = []
    for path, mod in model.named_modules(remove_duplicate=False):
        if not path:
            continue
        layer = next((layer_of[id(m)] for p, m in _ancestors(model, path) if id(m) in layer_of), None)
        output, w_in, w_out = widths.of(mod, path, model, id(mod) in layer_of)
        if output == "norm":
            output = norm_kind(model, path, layer)
            w_in = None if output == "heads" else w_in
        if id(mod) in unused:
            output, w_in, w_out = "none", None, None
        # a forward vLLM never calls has no ops to tap either
        ops = () if id(mod) in unused else source_ops(mod, model, path, widths, layer_of.get(id(mod)))
        nodes.append(Node(path=path, cls=type(mod).__name__, output=output, in_width=w_in, out_width=w_out,
                          layer=layer, source_ops=ops, in_moe_op=id(mod) in in_op, why=partial.get(id(mod), "")))
        router = _router(mod)
        if router is not None:
            nodes.append(Node(path=f"{path}.router", cls=type(router).__name__, output="routing",
                              in_width=None, out_width=int(router.top_k), layer=layer,
                              in_moe_op=True))
    arch = (getattr(hf, "architectures", None) or [type(model).__name__])[0]
    dtype = str(getattr(hf, "torch_dtype", None) or getattr(hf, "dtype", None) or torch.bfloat16)
    return ModuleTree(model=model_dir, architecture=arch, hidden_size=hidden, num_layers=len(layers),
                      vocab_size=int(getattr(hf, "vocab_size", 0)), dtype=dtype.replace("torch.", ""),
                      layers_path=layers_path, vllm_version=vllm_version(), nodes=tuple(nodes))


def _moe_op_modules(model) -> tuple[set[int], set[int]]:
    """ids of the modules that run inside a fused-MoE op (every module under an MoE runner: vLLM
    calls them from the op's `_forward_impl`; a module the model also holds under another name,
    Qwen3-MoE's `mlp.gate` = `mlp.experts.gate`, is the same object), and of those whose
    `forward` vLLM never calls: the runner's routed experts and their quant method (run through
    `forward_modular` / `apply`), the shared-experts wrapper (it stores its output instead of
    returning it; its `_layer`, the shared expert itself, is called), and gates whose weights
    the runner fuses with the shared-expert gate into one matmul."""
    import torch
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

    in_op: set[int] = set()
    unused: set[int] = set()
    for runner in (m for m in model.modules() if isinstance(m, MoERunnerInterface)):
        inside = {id(m) for m in runner.modules() if m is not runner}
        in_op |= inside
        called: set[int] = set()
        fused = getattr(runner, "_fse_fuse_gate", False)
        shared = getattr(getattr(runner, "shared_experts", None), "_layer", None)
        for part in (None if fused else getattr(runner, "gate", None), shared):
            if isinstance(part, torch.nn.Module):
                called.update(id(m) for m in part.modules())
        unused |= inside - called
        if fused:
            unused.update(id(g) for g in (runner.gate, runner.shared_expert_gate))
    return in_op, unused


def _mla_internals(model) -> dict[int, str]:
    """ids of the modules inside vLLM's MLA attention (DeepSeek-V2/V3, Kimi K2) that are not
    called on every row, and why: `kv_b_proj`, which the attention runs on prefill rows only
    (decode folds its weights into the kernel), and the fp8 input quantizers, run only with an
    fp8 KV cache. A tap there would capture some rows or none."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    out: dict[int, str] = {}
    for attn in (m for m in model.modules() if isinstance(m, MLAAttention)):
        out[id(attn.kv_b_proj)] = ("vLLM's MLA attention runs `kv_b_proj` on prefill rows only (decode folds its "
                                   "weights into the attention kernel), so a tap there would miss every decode row; "
                                   "the attention's output is `self_attn.o_proj.input`")
        for name, child in attn.named_children():
            if "quant" in name:
                out[id(child)] = ("an fp8 quantizer inside vLLM's MLA attention, run only with an fp8 KV cache; "
                                  "tap its projections, or its output at `self_attn.o_proj.input`")
    return out


def _router(mod):
    """The router of an MoE runner (`select_experts`: top-k experts per token), a plain object
    tapc names `<runner>.router`; None for other modules."""
    import torch
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

    router = getattr(mod, "router", None) if isinstance(mod, MoERunnerInterface) else None
    if router is None or isinstance(router, torch.nn.Module) or not hasattr(router, "top_k"):
        return None
    return router


def _meta_model(model_dir: str, engine_args: dict):
    """vLLM's model on meta: CPU platform for the config, a one-rank gloo group, `_C` stood in for."""
    import torch
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    config = EngineArgs(model=model_dir, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
                        max_model_len=256, **engine_args).create_engine_config()

    class _KernelStub:  # layers look kernels up while constructing; the meta tree never runs them
        def __getattr__(self, name):
            return lambda *a, **k: None

    torch.ops.__dict__["_C"] = _KernelStub()
    with set_current_vllm_config(config), _meta_mla_backend():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp(prefix='tapc-tree-')}")
        initialize_model_parallel(1, 1)
        with torch.device("meta"):
            model = initialize_model(vllm_config=config)
            if config.lora_config is not None:
                _wrap_lora(model, config)
    model.config = config.model_config.hf_config
    return model


@contextlib.contextmanager
def _meta_mla_backend():
    """MLA attention (DeepSeek-V2/V3, Kimi K2) asks the platform for an attention backend as it
    is built, and vLLM's CPU platform has none ("MLA is not supported on CPU"). The tree only
    needs the modules: a backend that makes an implementation holding its arguments, and no
    prefill backend, for the build. The engine on the GPU gets vLLM's own."""
    from unittest import mock

    import vllm.model_executor.layers.attention.mla_attention as mla

    class Impl:
        is_sparse = False

        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class Backend:
        get_name = staticmethod(lambda: "TAPC_META_MLA")
        is_mla = staticmethod(lambda: True)
        get_impl_cls = staticmethod(lambda: Impl)

    with mock.patch.object(mla, "get_attn_backend", lambda *a, **k: Backend), \
            mock.patch.object(mla, "get_mla_prefill_backend", lambda config: (lambda **kwargs: None)):
        yield


def _wrap_lora(model, config) -> None:
    """Wrap the layers vLLM wraps for LoRA (those `lora_target_modules` names, default all), as
    the engine's runner does when it loads a model with `enable_lora`: its LoRA manager replaces
    `qkv_proj` by `MergedQKVParallelLinearWithLoRA` around the original, now
    `qkv_proj.base_layer`, and so on. On meta, the adapters' weight slots cost nothing."""
    import torch
    from vllm.lora.model_manager import create_lora_manager

    sched = config.scheduler_config
    try:
        create_lora_manager(model, max_num_seqs=sched.max_num_seqs,
                            max_num_batched_tokens=sched.max_num_batched_tokens,
                            vocab_size=config.model_config.get_vocab_size(), lora_config=config.lora_config,
                            vllm_config=config, device=torch.device("meta"))
    except AssertionError as e:
        # vLLM's MoE LoRA wrapper refuses the CPU platform's (monolithic) MoE kernel
        raise ResolveError(f"tapc cannot build the LoRA tree of this model on the CPU: vLLM's LoRA wrapping "
                           f"refused it ({e}); LoRA on MoE models is not supported yet") from None


def _lora_base_layers(model) -> set[int]:
    """ids of the modules inside a LoRA-wrapped linear layer's `base_layer`: the wrapper runs
    the base layer's matmul itself (its quant method), not its forward, so nothing there is
    called; the wrapper's `.output` is the adapted output."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    return {id(m) for w in model.modules() if isinstance(w, BaseLinearLayerWithLoRA) for m in w.base_layer.modules()}


def _find_layers(model):
    """The ModuleList of decoder layers: the longest numbered ModuleList in the model."""
    import torch

    best = ("", [])
    for path, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > len(best[1]):
            best = (path, list(mod))
    if not best[1]:
        raise ResolveError(f"{type(model).__name__}: no ModuleList of decoder layers found")
    return best


def _ancestors(model, path: str):
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        p = ".".join(parts[:i])
        yield p, model.get_submodule(p)


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    print(build_tree(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else None).to_json())
