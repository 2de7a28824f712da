"""The README's set-up commands run on a stock Debian/Ubuntu Python (PEP 668: no `pip install`
outside a virtual environment), and CI runs the README's test command as it stands."""
import re

from places import ROOT



def setup_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


def test_setup_commands_make_and_use_a_venv():
    commands = setup_commands()
    assert len(commands) == 2, commands
    for command in commands:
        steps = [s.strip() for s in command.split("&&")]
        assert steps[0] == "python3 -m venv .venv", command
        assert all(not re.match(r"(python3 -m )?pip ", s) for s in steps), f"a bare pip is refused by PEP 668: {command}"
        assert all(s.startswith(".venv/bin/") for s in steps[1:]), command


def test_ci_runs_the_readme_test_command():
    test_command = next(c for c in setup_commands() if "pytest" in c)
    ci = [line for line in ROOT.joinpath(".ci", "run").read_text().splitlines() if line and not line.startswith("#")]
    assert test_command in ci, ci
    assert ".[test]" in test_command, "CI installs everything the tests need"


def test_the_main_job_installs_what_it_needs_not_the_test_extra():
    main = next(c for c in setup_commands() if "pytest" not in c)
    steps = [s.strip() for s in main.split("&&")]
    assert ".venv/bin/pip install -e ." in steps, main
    assert "[test]" not in main, "`tapc explain` needs tapc and vLLM, not the test extra"
    assert steps[-1].startswith(".venv/bin/tapc "), main
