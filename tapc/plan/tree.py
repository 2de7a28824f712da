"""vLLM's module tree of a model as plain data, and where it comes from.

`load_tree(model)` returns a `ModuleTree`: every module path vLLM names (`model.layers.0.mlp
.gate_up_proj`), its role, its per-token widths, and the `.source` ops of its forward. The
tree is built on the meta device in a child process (`tapc/plan/metamodel.py`: a child keeps
this process clean for a real engine later) and cached on disk by config, vLLM version, engine
arguments and the code that builds it (BUILD_CODE).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tapc.errors import ResolveError
from tapc.installed import cache_dir, status, vllm_version
from tapc.plan.modeldir import check_architecture, check_config, config_path


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


# The files of the code that builds a tree (this one's values, the build, the forwards' analysis):
# the cache key covers them, so a change to any builds the cached trees again.
BUILD_CODE = ("tree.py", "metamodel.py", "forwards.py")


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
    check_architecture(cfg, check_config(cfg)["architectures"])
    args = json.dumps(tree_args(engine_args), sort_keys=True)
    code = b"".join(Path(__file__).with_name(name).read_bytes() for name in BUILD_CODE)
    key = hashlib.sha256(cfg.read_bytes() + vllm_version().encode() + code + args.encode()).hexdigest()[:20]
    cached = cache_dir() / f"{key}.json"
    tree = _cached(cached)
    if tree is not None:
        return dataclasses.replace(tree, model=model)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR", "CUDA_VISIBLE_DEVICES": ""}
    with status(f"building vLLM's module tree for {model} on the meta device (once per config; cached)"):
        proc = subprocess.run([sys.executable, "-m", "tapc.plan.metamodel", str(cfg.parent), args], capture_output=True,
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
