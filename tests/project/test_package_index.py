"""Each package's index docstring (its `__init__.py`) names every module of the package, so that
a reader who opens the package first finds what each file holds."""
import ast
import re

import pytest
from places import ROOT

TAPC = ROOT / "tapc"
PACKAGES = sorted(p.parent for p in TAPC.glob("*/__init__.py"))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_the_index_names_every_module(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    named = set(re.findall(r"`(\w+)(?:\.py)?`", doc))
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    assert modules <= named, f"tapc/{package.name}/__init__.py does not name {sorted(modules - named)}"


def test_every_package_is_looked_at():
    assert {p.name for p in PACKAGES} >= {"api", "harvest", "kernels", "lang", "plan", "serving", "wire", "worker"}
