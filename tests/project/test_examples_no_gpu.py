"""Each example on a machine without a CUDA GPU: one line saying it needs one, not a traceback."""
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from places import EXAMPLES, SCRIPTS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a CUDA GPU")
def test_every_example_without_a_gpu_ends_in_one_line():
    def run(script):
        return subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(SCRIPTS.values(), pool.map(run, SCRIPTS.values())))
    for script, proc in done.items():
        name = script.rpartition("/")[2]
        assert (proc.returncode, proc.stdout, proc.stderr) == \
            (1, "", f"{name}: the engine needs a CUDA GPU, and torch sees none here; `tapc explain` shows the plan "
                    "on any machine\n"), script
