"""The capture arena: shared files another process reads, space reused, a full /dev/shm refused."""
import errno
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from engine_toy import Req, ToyModel, hooks_for, run, toy_plan

from tapc.engine.arena import Arena, ArenaReader
from tapc.engine.requests import TapRequest, to_wire


def test_another_process_reads_what_the_worker_wrote():
    arena = Arena(segment_bytes=1 << 16)
    t = arena.tensor(5, 2, 8, torch.bfloat16)
    t.copy_(torch.arange(80, dtype=torch.bfloat16).view(5, 2, 8))
    path, offset = arena.locate(t)
    code = ("import torch; from tapc.engine.arena import ArenaReader; "
            f"v = ArenaReader().view({path!r}, {offset}, (5, 2, 8), torch.bfloat16); print(v.float().sum().item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) == sum(range(80))
    assert torch.equal(ArenaReader().view(path, offset, (5, 2, 8), torch.bfloat16), t)
    arena.close()
    assert not os.path.exists(path)


def test_freed_space_merges_and_is_reused():
    arena = Arena(segment_bytes=4096)
    a, b, c = (arena.tensor(1, 1, 256, torch.float32) for _ in range(3))   # 1024 bytes each
    assert [arena.locate(x)[1] for x in (a, b, c)] == [0, 1024, 2048]
    arena.give_back(b)
    arena.give_back(a)
    big = arena.tensor(2, 1, 256, torch.float32)
    assert arena.locate(big) == (arena.path(0), 0), "a and b merged into one 2048-byte run"
    huge = arena.tensor(4, 1, 512, torch.float32)                            # more than a segment
    assert arena.locate(huge) == (arena.path(1), 0) and os.path.getsize(arena.path(1)) == 8192
    arena.close()


def test_full_shm_is_a_clear_request_error(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    plan = toy_plan(["model.layers.*.resid"])
    runner, hooks = hooks_for(plan, ToyModel())
    wire = to_wire(plan, TapRequest(capture="*"), "r")
    run(runner, [Req("r", np.arange(6).tolist(), 3, wire)], budget=64)
    error = hooks.collect([wire["id"]])[wire["id"]]["error"]
    assert "no room for its captures" in error and "--shm-size" in error
    assert not os.listdir("/dev/shm") or not any(f.startswith(hooks.arena.prefix) for f in os.listdir("/dev/shm"))


def test_release_gives_every_chunk_back():
    plan = toy_plan(["model.layers.*.resid"])
    runner, hooks = hooks_for(plan, ToyModel())
    wire = to_wire(plan, TapRequest(capture="*"), "r")
    run(runner, [Req("r", np.arange(6).tolist(), 3, wire)], budget=64)
    hooks.collect([wire["id"]])
    assert hooks.arena.held
    hooks.release([wire["id"]])
    assert not hooks.arena.held and hooks.arena.free == [[(0, 4096)]]
