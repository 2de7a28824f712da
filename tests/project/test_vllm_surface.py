"""Each vLLM internal tapc touches (tapc/vllm_surface.py) that its `versions` give the installed
release exists there, and every vLLM module tapc imports is listed: a vLLM that moved one fails
here, one line a name."""
import ast
import importlib
import inspect
import re

import pytest
from places import ROOT

from tapc.plan.forwards import forward_calls
from tapc.vllm_surface import INTERNALS, Internal, release

TAPC = ROOT / "tapc"


def _sets_on_self(klass, attr: str) -> bool:
    """Whether a method of `klass` assigns `self.<attr>`."""
    try:
        tree = ast.parse(inspect.getsource(klass).lstrip())   # a nested class is indented; its body stays consistent
    except (OSError, TypeError, SyntaxError):
        return False
    targets = (t for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
    return any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name) and t.value.id == "self"
               for t in targets)


def _has_field(klass, attr: str) -> bool:
    return hasattr(klass, attr) or any(attr in vars(k).get("__annotations__", {}) or _sets_on_self(k, attr)
                                       for k in klass.__mro__)


def resolves(entry: Internal) -> bool:
    import torch

    try:
        module = importlib.import_module(entry.module)
    except ImportError:
        return False
    if entry.kind == "env":
        return entry.path in module.environment_variables
    if entry.kind == "op":
        return hasattr(torch.ops.vllm, entry.path)
    if entry.kind == "text":
        return entry.path in inspect.getsource(module)
    parts = entry.path.split(":")[0].split(".")
    last = parts.pop() if entry.kind in ("field", "call") else None
    obj = module
    for part in parts:
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    if entry.kind == "field":
        return inspect.isclass(obj) and _has_field(obj, last)
    if entry.kind == "call":
        found = forward_calls(obj) if last == "forward" else None
        return found is not None and entry.path.rpartition(":")[2] in dict(found[2])
    return True


def test_every_internal_resolves():
    import vllm

    on = release(vllm.__version__)
    # a release no entry names would check nothing: its marks come from the probe first
    assert any(on in e.versions for e in INTERNALS), f"no entry of tapc/vllm_surface.py is marked {on}"
    missing = [f"vllm {vllm.__version__} lacks {e.dotted} (tapc uses it for {e.use}: {e.user})"
               for e in INTERNALS if on in e.versions and not resolves(e)]
    assert not missing, "\n".join(missing)


def test_entries_are_well_formed():
    kinds = {"object", "field", "env", "op", "text", "call"}
    assert [e.name for e in INTERNALS if e.kind not in kinds or not (TAPC.parent / e.user).is_file()] == []
    named = re.compile(r"\d+\.\d+").fullmatch   # a release as `release` names it: "0.26"
    assert [e.name for e in INTERNALS if not e.versions or not all(map(named, e.versions))] == []
    assert len({(e.name, e.kind) for e in INTERNALS}) == len(INTERNALS)


def test_every_vllm_import_is_listed():
    modules = {e.module for e in INTERNALS}
    names = {f"{e.module}.{e.path.split(':')[0].split('.')[0]}" for e in INTERNALS}
    unlisted = []
    for path in sorted(TAPC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                imported = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" not in names]
            elif isinstance(node, ast.Import):
                imported = [a.name for a in node.names if a.name.split(".")[0] == "vllm" and a.name not in modules]
            else:
                continue
            unlisted += [f"{path.relative_to(TAPC.parent)}:{node.lineno} imports {n}" for n in imported]
    assert not unlisted, "not in tapc/vllm_surface.py:\n" + "\n".join(unlisted)


@pytest.mark.parametrize("name, kind", [("vllm.config:VllmConfig.no_such_name", "object"),
                                        ("vllm.config:VllmConfig.no_such_name", "field"),
                                        ("vllm.envs:VLLM_NO_SUCH_NAME", "env"),
                                        ("vllm.model_executor.layers.attention.attention:no_such_op", "op"),
                                        ("vllm.model_executor.models.qwen3:Qwen3Attention.forward:no_such_0", "call")])
def test_a_missing_name_does_not_resolve(name, kind):
    assert not resolves(Internal(name, kind, "", "", ("0.26",)))
