"""No test module imports another: what several test modules share lives in tests/support, the
folder conftest.py puts on sys.path."""
import ast

from places import ROOT


def test_no_module_of_the_suite_imports_a_test_module():
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[-1].startswith("test_") or name.split(".")[0].startswith("test_")]
    assert not found, "test modules imported:\n" + "\n".join(found)
