"""vLLM's module tree of a model, built on the meta device with no GPU, as plain data.

`load_tree(model)` returns a `ModuleTree`: every module path vLLM names (`model.layers.0.mlp
.gate_up_proj`), its role, its per-token widths, and the `.source` ops of its forward. The
tree is built in a child process (vLLM's platform, distributed state and `torch.ops._C` are
swapped for the build; a child keeps this process clean for a real engine later) and cached on
disk by config, vLLM version and this file's contents.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tapc import paths
from tapc.errors import ResolveError
from tapc.installed import cache_dir, status, vllm_names, vllm_version


@dataclass(frozen=True)
class SourceOp:
    """A call inside a module's forward, named as nnsight names it: `<receiver>_<callee>_<k>`."""

    name: str                              # e.g. "qkv_split_0", "self_o_proj_0"
    call: str                              # the call as written, e.g. "qkv.split([...], dim=-1)"
    line: int                              # line in the forward's source file
    out_widths: tuple[int, ...] | None     # one entry per output tensor (a tuple when > 1); None: unknown
    in_width: int | None                   # width of the first positional argument; None: unknown
    linear: bool = False                   # a call of a vLLM linear layer: returns (out, bias)


@dataclass(frozen=True)
class Node:
    """One module of the tree.

    output: "tensor" | "linear" (returns (out, bias): `.output` is `out`) | "pair" (a decoder
    layer's (hidden_states, residual)) | "norm" (a norm its caller gives a residual: returns
    (normed, residual); a norm called without one is a "tensor") | "heads" (called on a per-head
    view [tokens, heads, head_dim], e.g. Qwen3's q_norm: no [tokens, width] rows to tap) |
    "tuple" (several tensors, e.g. rotary (q, k)) | "routing" (an MoE router's choice, not a
    module: `select_experts` returns (topk_weights, topk_ids), each [tokens, top_k]; `out_width`
    is top_k) | "none" (not tappable: token ids in, or not
    called in the forward). The kind is per call site: vLLM calls layer 0's input_layernorm
    without a residual and the others' with one, so the two nodes differ.

    in_moe_op: the module runs inside vLLM's fused-MoE op (`vllm::moe_forward`: the router, the
    experts, the shared expert, and the gate where the MoE layer holds it), which the compiled
    graph calls as one opaque op: in-graph taps run there (their kernels are captured with the
    op's), a Python block cannot (the graph cannot be split inside the op).

    why: for a "none" node, why it is not tappable where there is more to say than "not called"
    (MLA attention's `kv_b_proj`, called on prefill rows only); the tap's error says it.
    """

    path: str
    cls: str
    output: str
    in_width: int | None
    out_width: int | None
    layer: int | None = None
    source_ops: tuple[SourceOp, ...] = ()
    in_moe_op: bool = False
    why: str = ""


@dataclass(frozen=True)
class ModuleTree:
    model: str
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    dtype: str
    layers_path: str                 # the ModuleList of decoder layers, e.g. "model.layers"
    vllm_version: str
    nodes: tuple[Node, ...]

    @cached_property
    def by_path(self) -> dict[str, Node]:
        return {n.path: n for n in self.nodes}

    @cached_property
    def _children(self) -> dict[str, list[str]]:
        index: dict[str, list[str]] = {}
        for n in self.nodes:
            parent, _, name = n.path.rpartition(".")
            index.setdefault(parent, []).append(name)
        return index

    def children(self, path: str) -> list[str]:
        """Direct children's last segment, in model order ("" is the root)."""
        return self._children.get(path, [])

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ModuleTree":
        d = json.loads(text)

        def op(o):
            return SourceOp(**{**o, "out_widths": None if o["out_widths"] is None else tuple(o["out_widths"])})

        nodes = tuple(Node(**{**n, "source_ops": tuple(op(o) for o in n["source_ops"])}) for n in d["nodes"])
        return cls(**{**d, "nodes": nodes})


# ----------------------------------------------------------------------------- loading + cache


def config_path(model: str) -> Path:
    """config.json of a local directory, or of a hub id already in the local HF cache."""
    if not str(model).strip():
        raise ResolveError("the model is empty: give a directory with config.json, or a hub id")
    try:
        local = Path(model).expanduser()
    except RuntimeError:   # `~user` of a user this machine does not have
        raise ResolveError(f"{paths.shown(model)}: its `~` names no home directory on this machine") from None
    found = paths.kind(local, "model", ResolveError)
    if found == "dir":
        if paths.kind(local / "config.json", "model", ResolveError) == "file":
            return local / "config.json"
        raise ResolveError(f"{model}: a directory without config.json")
    if found is not None:
        hint = "give the folder that holds it" if local.name == "config.json" else "give a directory with config.json"
        raise ResolveError(f"{paths.shown(model)}: a file, not a model directory; {hint}")
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # an id that is not a valid repo name
        found = None
    if isinstance(found, str):
        return Path(found)
    raise ResolveError(f"{paths.shown(model)}: no such directory, and no config.json for it in the local Hugging Face "
                       "cache (tapc builds trees offline: give a local directory with config.json)")


MAX_CONFIG_BYTES = 4 << 20  # a config.json is a few kB; refuse to parse anything near this


def check_config(cfg: Path) -> dict:
    """config.json as a mapping that names its architecture, or a ResolveError naming the file and field.
    Cheap: runs before anything imports vLLM."""
    if cfg.stat().st_size > MAX_CONFIG_BYTES:
        raise ResolveError(f"{cfg}: {cfg.stat().st_size} bytes, too large for a model config (at most {MAX_CONFIG_BYTES})")
    try:
        data = json.loads(cfg.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise ResolveError(f"{cfg}: not valid JSON{where}: {getattr(e, 'msg', e)}") from None
    if not isinstance(data, dict):
        raise ResolveError(f"{cfg}: a model config is a JSON object, not {type(data).__name__}")
    archs = data.get("architectures")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise ResolveError(f"{cfg}: field `architectures` is {'missing' if archs is None else repr(archs)}; it names "
                           'the model class vLLM builds, e.g. "architectures": ["LlamaForCausalLM"]')
    return data


def _check_architecture(cfg: Path, archs: list[str]) -> None:
    """An architecture vLLM has no model class for, said in one line (vLLM's own error is a page)."""
    supported = vllm_names().get("architectures")
    if supported and not any(a in supported for a in archs):
        import difflib

        near = difflib.get_close_matches(archs[0], supported, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise ResolveError(f"{cfg}: field `architectures` is {archs}: vLLM {vllm_version()} has no model class "
                           f"for {'it' if len(archs) == 1 else 'them'}{hint}")


# Engine arguments that change the module tree (LoRA-wrapped layers, and which layers vLLM wraps),
# with the values a tree is built for when the caller does not give them. Not the parallel
# sizes: the tree is always the single-GPU one (results come back in its layout); the plan keeps
# the sizes and tapc/plan/sharding.py says what each GPU holds.
TREE_ENGINE_ARGS = {"enable_lora": False, "lora_target_modules": None}


def tree_args(engine_args: dict | None) -> dict:
    """The engine arguments of TREE_ENGINE_ARGS, from the engine's (others are ignored)."""
    return {k: (engine_args or {}).get(k, default) for k, default in TREE_ENGINE_ARGS.items()}


def load_tree(model: str, engine_args: dict | None = None) -> ModuleTree:
    """The module tree of `model` as an engine with `engine_args` builds it, from the disk cache
    or built in a child process."""
    cfg = config_path(model)
    _check_architecture(cfg, check_config(cfg)["architectures"])
    args = json.dumps(tree_args(engine_args), sort_keys=True)
    key = hashlib.sha256(cfg.read_bytes() + vllm_version().encode() + Path(__file__).read_bytes()
                         + args.encode()).hexdigest()[:20]
    cached = cache_dir() / f"{key}.json"
    tree = _cached(cached)
    if tree is not None:
        return dataclasses.replace(tree, model=model)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR", "CUDA_VISIBLE_DEVICES": ""}
    with status(f"building vLLM's module tree for {model} on the meta device (once per config; cached)"):
        proc = subprocess.run([sys.executable, "-m", "tapc.plan.tree", str(cfg.parent), args], capture_output=True,
                              text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
        raise ResolveError(f"could not build vLLM's module tree for {model}:\n{tail}")
    text = proc.stdout.strip().splitlines()[-1]
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(cached)
    return dataclasses.replace(ModuleTree.from_json(text), model=model)


def _cached(path: Path) -> ModuleTree | None:
    """The tree cached at `path`; None where there is none, or where the file is damaged (a
    write cut short, a disk error): it is said, and the tree is built again over it."""
    if not path.is_file():
        return None
    try:
        return ModuleTree.from_json(path.read_text())
    except (ValueError, TypeError, KeyError) as e:   # bad JSON or text, or not a tree's fields
        print(f"tapc: the cached module tree {path} is damaged ({type(e).__name__}); building it again",
              file=sys.stderr)
        return None


# ----------------------------------------------------------------------------- building (child process)


def build_tree(model_dir: str, engine_args: dict | None = None) -> ModuleTree:
    """Build vLLM's model for `model_dir` on the meta device and describe it. Needs no GPU.
    `engine_args`: those of TREE_ENGINE_ARGS the engine runs with."""
    import torch

    model = _meta_model(model_dir, tree_args(engine_args))
    hf = model.config if hasattr(model, "config") else None
    layers_path, layers = _find_layers(model)
    layer_of = {id(m): i for i, m in enumerate(layers)}
    hidden = int(getattr(hf, "hidden_size"))
    widths = _Widths(hidden)
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
            output = _norm_kind(model, path, layer)
            w_in = None if output == "heads" else w_in
        if id(mod) in unused:
            output, w_in, w_out = "none", None, None
        # a forward vLLM never calls has no ops to tap either
        ops = () if id(mod) in unused else _source_ops(mod, model, path, widths, layer_of.get(id(mod)))
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


def _norm_kind(model, path: str, layer: int | None) -> str:
    """What a norm returns where its caller calls it: "norm" (normed, residual) when called with a
    residual, "tensor" without, "heads" on a per-head view. vLLM's decoder layers call their first
    norm under `if residual is None:` without one, and the stack starts with residual None: so
    that norm returns one tensor in layer 0 and a pair in the others."""
    parent_path, _, attr = path.rpartition(".")
    sites = _call_sites(type(model.get_submodule(parent_path)) if parent_path else type(model), attr)
    if not sites:
        return "tensor"  # not called where we can read it: refuse elements rather than guess
    if any(s.per_head for s in sites):
        return "heads"
    if all(s.args >= 2 for s in sites):
        return "norm"
    if all(s.args == 1 for s in sites):
        return "tensor"
    guarded = all(s.under_none_check for s in sites if s.args == 1)
    return ("tensor" if layer == 0 else "norm") if guarded and layer is not None else "tensor"


@dataclass(frozen=True)
class _CallSite:
    args: int                 # arguments passed (positional and keyword)
    under_none_check: bool    # inside the body of an `if X is None:`
    per_head: bool            # its first argument was made by `.view(...)`/`.reshape(...)` with more dims


def _none_branches(fn: ast.FunctionDef) -> tuple[set[int], set[int]]:
    """ids of the AST nodes in the bodies, and in the else branches, of `if X is None:` in `fn`."""
    body: set[int] = set()
    orelse: set[int] = set()
    for node in ast.walk(fn):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and isinstance(test, ast.Compare) and len(test.ops) == 1 \
                and isinstance(test.ops[0], ast.Is) and isinstance(test.comparators[0], ast.Constant) \
                and test.comparators[0].value is None:
            body.update(id(n) for stmt in node.body for n in ast.walk(stmt))
            orelse.update(id(n) for stmt in node.orelse for n in ast.walk(stmt))
    return body, orelse


def _per_head_names(fn: ast.FunctionDef) -> set[str]:
    """Names a forward assigns from a `.view`/`.reshape`/`.unflatten` into 3+ dims (a per-head view,
    `q.view(*q.shape[:-1], heads, head_dim)`): not [tokens, width] rows."""
    return {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in ("view", "reshape", "unflatten")
            and (len(node.value.args) >= 3 or any(isinstance(a, ast.Starred) for a in node.value.args))
            for t in node.targets if isinstance(t, ast.Name)}


def _call_sites(cls, attr: str) -> list[_CallSite]:
    """Every `self.<attr>(...)` in `cls.forward`."""
    found = forward_calls(cls)
    if found is None:
        return []
    fn, _, _ = found
    guarded, _ = _none_branches(fn)
    reshaped = _per_head_names(fn)
    sites = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
            first = node.args[0] if node.args else None
            sites.append(_CallSite(args=len(node.args) + len(node.keywords), under_none_check=id(node) in guarded,
                                   per_head=isinstance(first, ast.Name) and first.id in reshaped))
    return sites


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


class _Widths:
    """Per-token widths by module role; containers (attention block, MLP, MoE block) map hidden -> hidden."""

    def __init__(self, hidden: int):
        self.hidden = hidden

    def of(self, mod, path: str, model, is_layer: bool) -> tuple[str, int | None, int | None]:
        import torch
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        name = type(mod).__name__
        if is_layer:
            return "pair", self.hidden, self.hidden
        if name.endswith("WithLoRA") and isinstance(getattr(mod, "base_layer", None), torch.nn.Module):
            return self.of(mod.base_layer, path, model, False)   # a LoRA wrapper returns what its base returns
        if isinstance(mod, LinearBase):
            # ReplicatedLinear (MoE gates) has no per-partition sizes: it is not sharded
            w_in = getattr(mod, "input_size_per_partition", mod.input_size)
            return "linear", int(w_in), int(getattr(mod, "output_size_per_partition", mod.output_size))
        if isinstance(mod, VocabParallelEmbedding):
            return ("none", None, None) if "LMHead" in name else ("tensor", None, int(mod.embedding_dim))
        if name.endswith("Norm"):
            w = getattr(mod, "weight", None)
            width = int(w.shape[0]) if w is not None and w.dim() == 1 else self.hidden
            return "norm", width, width
        if hasattr(mod, "kv_lora_rank") and hasattr(mod, "v_head_dim") and hasattr(mod, "impl"):
            # MLA attention: called with (q per head, the kv latent, the rope key), returns
            # [tokens, heads * v_head_dim]; its head_size is the latent's, not the output's
            return "tensor", None, int(mod.num_heads * mod.v_head_dim)
        if name in ("Attention", "EncoderOnlyAttention") or hasattr(mod, "num_kv_heads") and hasattr(mod, "head_size"):
            width = int(mod.num_heads * mod.head_size)
            return "tensor", width, width
        if name.endswith("AndMul"):
            parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else None
            up = getattr(parent, "gate_up_proj", None)
            if up is not None:
                out = int(getattr(up, "output_size_per_partition", up.output_size)) // 2
                return "tensor", 2 * out, out
            return "tensor", None, None
        if "Rotary" in name or name == "ApplyRotaryEmb":
            return "tuple", None, None
        if name in ("LogitsProcessor", "ModuleList") or name.endswith("Sampler"):
            return "none", None, None
        return "tensor", self.hidden, self.hidden

    def of_child(self, owner, attr: str, model, path: str):
        child = getattr(owner, attr, None)
        import torch

        if not isinstance(child, torch.nn.Module):
            return None
        return self.of(child, f"{path}.{attr}", model, False)


def _call_name(func: ast.expr) -> str:
    """`self.qkv_proj` -> "self_qkv_proj"; `qkv.split` -> "qkv_split"; `f(x).view` -> "view"."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return "_".join(reversed(parts))


def forward_calls(cls) -> tuple[ast.FunctionDef, int, list[tuple[str, ast.Call]]] | None:
    """The parsed `cls.forward`, its first line in its file, and its calls in source order, each
    named as nnsight names them (`<receiver>_<callee>_<k>`). None when there is no source.
    The engine rewrites forwards with the same names (tapc/worker/source.py)."""
    try:
        lines, start = inspect.getsourcelines(cls.forward)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    counts: dict[str, int] = {}
    named = []
    for call in calls:
        base = _call_name(call.func)
        if not base:
            continue
        k = counts.get(base, 0)
        counts[base] = k + 1
        named.append((f"{base}_{k}", call))
    return tree.body[0], start, named


def _source_ops(mod, model, path: str, widths: _Widths, stack_index: int | None) -> tuple[SourceOp, ...]:
    """The calls in `type(mod).forward`, in source order, with widths where they can be known. In
    a decoder layer (`stack_index` its place in the stack), the calls under `if residual is None:`
    run only in layer 0 and those of its `else:` only after: each layer lists the calls it runs."""
    found = forward_calls(type(mod))
    if found is None:
        return ()
    fn, start, named = found
    per_head = _per_head_names(fn)
    first_only, later_only = _none_branches(fn) if stack_index is not None else (set(), set())
    skip = later_only if stack_index == 0 else first_only
    ops = []
    for name, call in named:
        if id(call) in skip:
            continue
        out_widths, in_width, linear = _call_widths(mod, model, path, call, widths, per_head)
        text = ast.unparse(call)
        ops.append(SourceOp(name=name, call=text if len(text) <= 80 else text[:77] + "...",
                            line=start + call.lineno - 1, out_widths=out_widths, in_width=in_width, linear=linear))
    return tuple(ops)


def _call_widths(mod, model, path: str, call: ast.Call, widths: _Widths, per_head: set[str]):
    """Widths of a call's output(s) and first input: submodule calls and `x.split([sizes])`. A
    norm's call is sized as it is made: on a per-head view, unsizable; with a residual, two tensors."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        role = widths.of_child(mod, func.attr, model, path)
        if role is not None:
            output, w_in, w_out = role
            if output in ("tuple", "none") or w_out is None:
                return None, w_in, False
            if output == "norm":
                if call.args and isinstance(call.args[0], ast.Name) and call.args[0].id in per_head:
                    return None, None, False
                n_args = len(call.args) + len(call.keywords)
                return ((w_out, w_out) if n_args >= 2 else (w_out,)), w_in, False
            return (w_out,), w_in, output == "linear"
    if isinstance(func, ast.Attribute) and func.attr == "split" and call.args:
        try:  # sizes are usually attributes of self: qkv.split([self.q_size, self.kv_size, self.kv_size])
            sizes = eval(compile(ast.Expression(call.args[0]), "<split>", "eval"), {"__builtins__": {}}, {"self": mod})
        except Exception:
            return None, None, False
        if isinstance(sizes, (list, tuple)) and all(isinstance(s, int) for s in sizes):
            return tuple(int(s) for s in sizes), int(sum(sizes)), False
    return None, None, False


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    print(build_tree(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else None).to_json())
