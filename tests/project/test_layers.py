"""The import rules between tapc's packages (pyproject.toml's import-linter contracts,
docs/architecture.md) hold for the code as it is."""
import subprocess
import sys

from places import ROOT



def test_the_packages_keep_their_import_rules():
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                                                "sys.exit(lint_imports_command())"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout, run.stdout[-4000:]
