"""The suite's own set-up: no helper module changes the process environment when imported (a
switch set there reaches every engine the suite starts after it), and a run where Triton's
interpreter is switched on beside CUDA is refused before any test."""
import os
import subprocess
import sys

from places import ROOT, SUPPORT

HELPERS = sorted(p.stem for p in SUPPORT.glob("*.py"))


def test_helper_modules_leave_the_environment_as_they_found_it():
    # as a GPU test worker imports them: CUDA present, the interpreter switch not set
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os, importlib, torch; torch.cuda.is_available = lambda: True; before = dict(os.environ)\n"
            f"for name in {HELPERS!r}:\n"
            "    importlib.import_module(name)\n"
            "    changed = sorted(k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k))\n"
            "    assert not changed, f'importing {name} changed {changed}'\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=SUPPORT, env={**env, "PYTHONPATH": str(SUPPORT)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert {"engine_toy", "gpu_engines", "harvest_child", "harvest_ray_child", "kernel_cases"} <= set(HELPERS)


def test_a_run_with_tritons_interpreter_beside_cuda_is_refused_in_one_line():
    # CUDA as conftest sees it, present; the interpreter switched on by the caller's environment
    code = ("import sys, torch, pytest; torch.cuda.is_available = lambda: True\n"
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only', 'tests/project/test_readme.py']))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]   # pytest's usage error
    assert run.stderr.strip() == ("ERROR: TRITON_INTERPRET='1' on a machine with CUDA: the GPU tests need compiled "
                                  "Triton kernels; unset it"), run.stderr
    assert "test_readme.py" not in run.stdout   # refused before collecting anything
