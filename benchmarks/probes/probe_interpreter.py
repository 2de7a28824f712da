"""Does Triton's interpreter, switched on in the environment, break inductor's compile on a GPU?
(tests/project/test_suite_guards.py, `require_cuda`)

    python3 benchmarks/probes/probe_interpreter.py

Compiles one function whose graph inductor may fuse into combo kernels, with the two inductor
settings vLLM 0.26 turns on (`combo_kernels`, `benchmark_combo_kernel`), in a child process
with TRITON_INTERPRET unset and in one with it set to 1, and prints how each ended: the first
line of the error, or the largest difference from eager.
"""
import os
import subprocess
import sys

CHILD = """
import torch, torch._inductor.config as c
c.combo_kernels = True
c.benchmark_combo_kernel = True
def f(a, b, x, y):
    return (a * 2 + 1).relu(), b.sum(0), torch.sigmoid(x) * y, (y - 3).abs().amax(1)
args = [torch.randn(s, device="cuda") for s in ((512, 64), (128, 32), (1024,), (1024, 1))]
try:
    got = torch.compile(f)(*args)
    print("compiled; max |diff| from eager:", max((g - e).abs().max().item() for g, e in zip(got, f(*args))))
except Exception as e:
    print("failed:", type(e).__name__, str(e).strip().splitlines()[-1][:200])
"""

if __name__ == "__main__":
    for value in (None, "1"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if value is not None:
            env["TRITON_INTERPRET"] = value
        run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        said = run.stdout.strip() or run.stderr.strip().splitlines()[-1]
        print(f"TRITON_INTERPRET={value}: {said}")
