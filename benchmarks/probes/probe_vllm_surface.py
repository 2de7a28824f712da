"""Which of the vLLM internals tapc touches (tapc/vllm_surface.py) another vLLM release still
has, read from its source without installing it (a release may need another torch):

    python3 benchmarks/probes/probe_vllm_surface.py vllm-X.Y.Z-...whl   # or an unpacked folder

Its release is read from its `vllm/_version.py` (0.34.0: "0.34"). The entries whose `versions`
mark that release are the ones tapc needs there: those missing are listed first. The entries
marked for other releases only follow apart, each absent or present (present: its marks lack this
release). A release that no entry is marked with has every entry read as needed.

Each entry resolves statically: the module's file exists; the path's first name is defined in
it (class, def, assignment) or imported into it (followed, relative imports too, and vLLM's
lazy `MODULE_ATTRS` table); a member of a class is defined or annotated in its body, assigned
to `self` in one of its methods, or found so in a base class (generic ones too); env vars are
keys of `vllm/envs.py`; ops are `op_name="..."` in the module; `.source` calls are named as tapc
names them (tapc/plan/forwards.py `named_calls`). A missing name is looked for elsewhere in the
release (`class`/`def`/`self.` of the same name): where it may have moved. A reading of the
source, not a run: it says nothing about how the code behaves.
"""
from __future__ import annotations

import ast
import re
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tapc.plan.forwards import named_calls
from tapc.vllm_surface import INTERNALS, release as vllm_release


class Release:
    """The `vllm/**.py` files of a wheel or folder, by path."""

    def __init__(self, where: str):
        if where.endswith(".whl"):
            with zipfile.ZipFile(where) as z:
                self.files = {n: z.read(n).decode() for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")}
        else:
            root = Path(where)
            self.files = {str(p.relative_to(root)): p.read_text() for p in root.glob("vllm/**/*.py")}
        self.trees: dict[str, ast.Module] = {}

    def file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        return next((f for f in (f"{base}.py", f"{base}/__init__.py") if f in self.files), None)

    def tree(self, module: str) -> ast.Module | None:
        f = self.file(module)
        if f is None:
            return None
        if f not in self.trees:
            self.trees[f] = ast.parse(self.files[f])
        return self.trees[f]

    def lookup(self, module: str, name: str, depth: int = 0):
        """(module, node) defining `name` at the top of `module`, following imports; None if absent."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        package = module if self.file(module).endswith("__init__.py") else module.rpartition(".")[0]
        found = None
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign)
                       else [])
            if (isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name) or any(
                    isinstance(t, ast.Name) and t.id == name for t in targets):
                found = found or (module, node)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name == "*":   # vllm/distributed/__init__.py: from .parallel_state import *
                        found = found or self.lookup(_absolute(node, package), name, depth + 1)
                    elif (a.asname or a.name) == name:
                        source = _absolute(node, package)
                        found = found or self.lookup(source, a.name, depth + 1) or (
                            (f"{source}.{a.name}", None) if self.file(f"{source}.{a.name}") else None)
            elif isinstance(node, ast.Dict):   # vllm/__init__.py's lazy table: "LLM": ".entrypoints.llm:LLM"
                for k, v in zip(node.keys, node.values):
                    if (isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant)
                            and isinstance(v.value, str) and ":" in v.value):
                        mod, _, attr = v.value.partition(":")
                        found = found or self.lookup(f"{package}{mod}" if mod.startswith(".") else mod, attr,
                                                     depth + 1)
        return found

    def member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> bool:
        """Whether class `cls` (defined in `module`) or a base has `name`: in its body, annotated,
        or assigned to `self` in a method."""
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return True
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for t in targets:
                if (isinstance(t, ast.Name) and t.id == name) or (
                        isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                        and t.value.id == "self"):
                    return True
        for base in cls.bases:
            if isinstance(base, ast.Subscript):   # a generic base: AttentionImplBase[T]
                base = base.value
            if depth < 8 and isinstance(base, ast.Name):
                found = self.lookup(module, base.id)
                if found and isinstance(found[1], ast.ClassDef) and self.member(found[0], found[1], name, depth + 1):
                    return True
        return False

    def resolves(self, entry) -> bool:
        module = entry.module
        if self.file(module) is None:
            return False
        text = self.files[self.file(module)]
        if entry.kind == "env":
            return f'"{entry.path}":' in text
        if entry.kind == "op":
            return re.search(rf'op_name\s*=\s*"{re.escape(entry.path)}"', text) is not None
        if entry.kind == "text":
            return entry.path in text
        first, *rest = entry.path.split(":")[0].split(".")
        found = self.lookup(module, first)
        if found is None:
            return False
        for i, part in enumerate(rest):
            where, node = found
            if not isinstance(node, ast.ClassDef) or not self.member(where, node, part):
                return False
            inner = next((n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part),
                         None)
            found = (where, inner)
        if entry.kind == "call":
            fn = found[1]
            return fn is not None and entry.path.rpartition(":")[2] in dict(named_calls(fn))
        return True

    def version(self) -> str:
        """vLLM's version, as the release's `vllm/_version.py` assigns `__version__`."""
        tree = self.tree("vllm._version")
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__"
                                                    for t in node.targets):
                return ast.literal_eval(node.value)
        raise SystemExit("the release has no vllm/_version.py with its __version__")

    def elsewhere(self, name: str) -> list[str]:
        """Files of the release that define `name` (class, def or `self.` attribute)."""
        pattern = re.compile(rf"^\s*(class|def|async def)\s+{re.escape(name)}\b|self\.{re.escape(name)}\s*[:=]", re.MULTILINE)
        return sorted(f for f, text in self.files.items() if pattern.search(text))


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module
    base = package.split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def report(release: Release) -> None:
    """Which entries tapc needs on the release (those its `versions` mark with it) are missing;
    then the entries marked for other releases only, each present or absent here."""
    version = release.version()
    on = vllm_release(version)
    marked = [e for e in INTERNALS if on in e.versions]
    if not marked:   # a release not read before: every entry is needed until it is marked
        print(f"no entry of tapc/vllm_surface.py is marked {on}: all {len(INTERNALS)} are read as needed")
    needed = marked or list(INTERNALS)
    others = [e for e in INTERNALS if on not in e.versions] if marked else []
    missing = [e for e in needed if not release.resolves(e)]
    scope = f" marked {on}" if marked else ""
    print(f"vLLM {version}: {len(needed) - len(missing)} of the {len(needed)} entries{scope} present, "
          f"{len(missing)} missing")
    for e in missing:
        print(f"- missing: {_described(release, e)}")
    if others:
        marks = ", ".join(sorted({v for e in others for v in e.versions}))
        print(f"{len(others)} entries marked only {marks}, not read as needed on {on}:")
        for e in others:
            present = release.resolves(e)   # present here: its `versions` lack this release
            print(f"- {f'present, not marked {on}' if present else 'absent'}: {_described(release, e, present)}")


def _described(release: Release, e, present: bool = False) -> str:
    """The entry in one line; an absent one with where it may have gone."""
    line = f"{e.dotted} [{e.kind}] ({e.use}: {e.user})"
    if present:
        return line
    parts = e.path.split(":")[0].split(".")
    gone = release.file(e.module) is None
    # where a missing class or function went; a member's name alone matches too much to say
    seen = release.elsewhere(parts[0]) if e.kind == "object" and len(parts) == 1 else []
    return line + ("; module gone" if gone else "") + ("; defined in " + ", ".join(seen) if seen else "")


if __name__ == "__main__":
    report(Release(sys.argv[1]))
