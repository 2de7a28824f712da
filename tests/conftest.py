import errno
import os
import sys
import tempfile
from pathlib import Path

import pytest

# Module trees are cached on disk; tests build their own in a fresh folder.
os.environ.setdefault("TAPC_CACHE", tempfile.mkdtemp(prefix="tapc-test-cache-"))


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# Without a GPU, Triton kernels run in its interpreter. Triton reads this when a kernel is
# defined, so it must be set before anything imports tapc.kernels.
if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The helpers (engine_toy, gpu_engines, ...) are imported by name from tests/support.
sys.path.insert(0, str(Path(__file__).parent / "support"))


def pytest_configure(config):
    # An inherited interpreter switch runs every engine's inductor kernels on the CPU, where the
    # engines then die compiling their graphs: refuse the run rather than fail it test by test.
    from tapc.api.engine_args import triton_interpreter

    if _cuda() and triton_interpreter():
        raise pytest.UsageError(f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']!r} on a machine with CUDA: "
                                "the GPU tests need compiled Triton kernels; unset it")

# The GPU tests' shared checkpoints and engines (fixtures; nothing heavy is imported here).
from gpu_engines import checkpoints, engines, tapped_engine, vanilla_llama  # noqa: E402,F401
from places import CONFIGS  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _cuda():
        # Under pytest-xdist (`-n N --dist loadgroup`) a group runs on one worker: a GPU test
        # not marked with a session engine it shares (gpu_engines.shares) goes with its module,
        # whose module-scoped engines then start once.
        for item in items:
            if "gpu" in item.keywords and item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def trees():
    """vLLM module trees of the test configs, built once per session (no GPU)."""
    from tapc.plan.tree import load_tree

    cache: dict[str, object] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = load_tree(str(CONFIGS / arch))
        return cache[arch]

    return get


@pytest.fixture
def no_room_past_8k(monkeypatch):
    """/dev/shm as if full: an arena file of more than 8 kB cannot be made."""
    fallocate = os.posix_fallocate

    def refuse(fd, offset, size):
        if size > 8192:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fallocate(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", refuse)


@pytest.fixture(autouse=True)
def no_handler_left_behind():
    """engine_toy.hooks_for installs the runtime as the process-wide boundary handler: take it
    back after each test (only where the ops are loaded; plan tests stay free of them)."""
    yield
    ops = sys.modules.get("tapc.kernels.ops")
    if ops is not None:
        ops.set_boundary_handler(None)
