"""docs/architecture.md's route of one request names at most fifteen files, and every file and
function it names is in the code."""
import ast
import re

from tests.support.places import ROOT

ENTRY = re.compile(r"^\d+\. `(tapc/[\w/]+\.py)` `([\w.]+)`", re.M)


def route() -> list[tuple[str, str]]:
    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("## One request, in and out", 1)[1].split("\n## ", 1)[0]
    return ENTRY.findall(section)


def defined(path: str, name: str) -> bool:
    """Whether `name` (a function or class, or Class.method) is defined at the top of `path`."""
    scope = ast.parse((ROOT / path).read_text()).body
    for part in name.split("."):
        found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part]
        if not found:
            return False
        scope = found[0].body
    return True


def test_the_route_names_at_most_fifteen_files():
    steps = route()
    assert len(steps) >= 10, "the route's list was not found in docs/architecture.md"
    files = {path for path, _ in steps}
    assert len(files) <= 15, f"the route crosses {len(files)} files: {sorted(files)}"


def test_every_file_and_function_of_the_route_is_in_the_code():
    missing = [f"{path} {name}" for path, name in route() if not (ROOT / path).exists() or not defined(path, name)]
    assert not missing, f"docs/architecture.md's route names what the code lacks: {missing}"
