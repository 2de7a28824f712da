"""The capture arena: shared files another process reads, space reused, a full /dev/shm refused,
and captures handed to the caller without a copy, their space back only once the caller drops them."""
import errno
import os
import subprocess
import sys
import time

import gc

import numpy as np
import pytest
import torch
from engine_toy import Req, ToyModel, collect, hooks_for, run, toy_plan, wire_for

from tapc.wire.arena import Arena, ArenaReader
from tapc.api.requests import TapRequest
from tapc.errors import EngineError, RequestError
from tapc.api.session import TapSession


def test_another_process_reads_what_the_worker_wrote():
    arena = Arena(segment_bytes=1 << 16)
    t = arena.tensor(5, 2, 8, torch.bfloat16)
    t.copy_(torch.arange(80, dtype=torch.bfloat16).view(5, 2, 8))
    path, offset = arena.locate(t)
    code = ("import torch; from tapc.wire.arena import ArenaReader; "
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
    arena.give_back(*arena.locate(b))
    arena.give_back(*arena.locate(a))
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
    req = Req("r", np.arange(6).tolist(), 3, wire_for(plan, TapRequest(capture="*"), "r"))
    run(runner, [req], budget=64)
    error = collect(hooks, [req], TapSession(plan))["r"].error
    assert isinstance(error, RequestError) and "no room for its captures" in str(error) and "--shm-size" in str(error)
    assert not os.listdir("/dev/shm") or not any(f.startswith(hooks.arena.prefix) for f in os.listdir("/dev/shm"))


def test_captures_are_views_freed_only_when_the_caller_drops_them():
    plan = toy_plan(["model.layers.*.resid"])
    runner, hooks = hooks_for(plan, ToyModel())
    session = TapSession(plan)
    reader = session.arena
    rng = np.random.default_rng(5)

    def serve(rid: str, max_tokens: int, positions="all") -> dict[str, torch.Tensor]:
        req = Req(rid, rng.integers(0, 50, 6).tolist(), max_tokens,
                  wire_for(plan, TapRequest(capture="*", positions=positions), rid))
        run(runner, [req], budget=64)
        out = collect(hooks, [req], session)[rid]
        return dict(out.taps)

    first = serve("a", 3)
    kept = {k: v.clone() for k, v in first.items()}
    assert not any(v.numel() == 0 for v in first.values())
    hooks.release(reader.drain())                     # nothing: the caller holds every chunk
    held = dict(hooks.arena.held)
    assert held
    # A second request while the first's captures are alive: it gets other space, and the first
    # request's tensors still hold their own values.
    second = serve("b", 4)
    nothing = serve("c", 2, positions=[99])            # its one chunk gets no row: back at once
    assert all(v.shape[0] == 0 for v in nothing.values())
    for k in first:
        assert torch.equal(first[k], kept[k]), k
    hooks.release(reader.drain())
    assert set(held) <= set(hooks.arena.held)
    views = [first[k] for k in list(first)[:1]]        # the caller keeps one tensor of the first
    del first
    gc.collect()
    hooks.release(reader.drain())
    assert set(held) <= set(hooks.arena.held), "a view still alive keeps its chunk"
    del views, second
    gc.collect()
    hooks.release(reader.drain())
    assert not hooks.arena.held
    assert all(len(free) == 1 and free[0][0] == 0 for free in hooks.arena.free.values()), "freed runs merge back"


def test_a_chunk_given_back_twice_is_an_error():
    arena = Arena(segment_bytes=4096)
    path, offset = arena.locate(arena.tensor(1, 1, 16, torch.float32))
    arena.give_back(path, offset)
    with pytest.raises(ValueError, match="given back twice"):
        arena.give_back(path, offset)
    arena.close()


def test_memory_reserved_at_start_is_pinned_once_and_admissions_within_it_never_grow(caplog):
    pinned = []
    arena = Arena(register=lambda t: pinned.append(t.numel()), segment_bytes=4096)
    with caplog.at_level("INFO", logger="tapc"):
        arena.reserve(10_000)
    assert pinned == [10_240] and arena.size == 10_240, "one segment, rounded up to the alignment"
    assert "grew to" in caplog.text and "reserved at start" in caplog.text
    assert [r.levelname for r in caplog.records] == ["INFO"], "a reserve at start is no stall"
    arena.reserve(5_000)                                   # less than it holds: nothing to do
    blocks = [arena.tensor(1, 1, 512, torch.float32) for _ in range(5)]   # 2048 bytes each: all fit
    assert pinned == [10_240] and {arena.locate(b)[0] for b in blocks} == {arena.path(0)}
    caplog.clear()
    with caplog.at_level("INFO", logger="tapc"):
        arena.tensor(1, 1, 512, torch.float32)               # past the reserve: grows, and says so
    assert pinned == [10_240, 4096] and "while admitting requests: the step waited for it" in caplog.text
    assert [r.levelname for r in caplog.records] == ["WARNING"], "a stall on the step's path is a warning"
    assert arena.growth_s > 0
    arena.close()


def test_a_reserve_the_shm_cannot_hold_is_an_engine_error_naming_the_setting(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    arena = Arena(segment_bytes=4096)
    with pytest.raises(EngineError, match=r"capture_memory_gib=2: this GPU's worker cannot reserve it in .*--shm-size"):
        arena.reserve(2 << 30)
    assert arena.size == 0 and not any(f.startswith(arena.prefix) for f in os.listdir(arena.directory))


def test_a_killed_workers_files_are_swept_by_the_next_arena_and_no_living_ones(tmp_path):
    """A worker killed (SIGKILL) never removes its files: the next arena in the folder does, once
    they are older than STALE_S and no process holds their lock; a living arena's (in another
    process, its lock held) and a file just made stay."""
    from tapc.wire.arena import STALE_S

    code = ("import os, signal, sys, torch; from tapc.wire.arena import Arena; "
            f"a = Arena(directory={str(tmp_path)!r}, segment_bytes=4096); a.tensor(2, 1, 8, torch.float32); "
            "print(a.path(0), flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL) if sys.argv[1] == 'die' else sys.stdin.read()")
    dead = subprocess.run([sys.executable, "-c", code, "die"], capture_output=True, text=True)
    dead_path = dead.stdout.strip()
    living = subprocess.Popen([sys.executable, "-c", code, "live"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        living_path = living.stdout.readline().strip()
        young = tmp_path / "tapc-1-0123abcd-0"
        young.write_bytes(b"x" * 4096)
        old = time.time() - 2 * STALE_S
        for p in (dead_path, living_path):
            os.utime(p, (old, old))
        assert os.path.exists(dead_path), "a SIGKILL leaves the file behind"
        arena = Arena(directory=str(tmp_path), segment_bytes=4096)
        assert arena.swept == [os.path.basename(dead_path)]
        assert not os.path.exists(dead_path) and os.path.exists(living_path) and young.exists()
        arena.close()
    finally:
        living.stdin.close()
        living.wait(timeout=30)
    assert not os.path.exists(living_path), "a worker that exits removes its own"


def test_two_arenas_sweeping_one_dead_file_at_once_both_start(tmp_path, monkeypatch):
    """Two workers starting together on one host (a harvest over several GPUs) may both find a
    dead worker's file: the one that unlinks it second finds it gone and starts all the same
    (its sweep names only what it removed)."""
    import fcntl

    from tapc.wire import arena as arena_module

    stale = tmp_path / "tapc-1-0123abcd-0"
    stale.write_bytes(b"x" * 4096)
    old = time.time() - 2 * arena_module.STALE_S
    os.utime(stale, (old, old))
    lock = fcntl.flock

    def lock_then_lose_the_race(fd, op):   # the other arena unlinks it between our lock and unlink
        lock(fd, op)
        stale.unlink()

    monkeypatch.setattr(arena_module.fcntl, "flock", lock_then_lose_the_race)
    assert arena_module.sweep(str(tmp_path)) == []
    monkeypatch.setattr(arena_module.fcntl, "flock", lock)
    stale.write_bytes(b"x" * 4096)
    os.utime(stale, (old, old))
    assert arena_module.sweep(str(tmp_path)) == [stale.name] and not stale.exists()
