"""A bounded capture arena (`capture_memory_keep_gib`): what a burst grew past the bound goes
back once no capture is held in it, and a block still held is never freed. Real shared-memory
segments, small ones, in a temporary folder."""
import gc
import os
import shlex
import textwrap

import numpy as np
import pytest
import torch
from places import CONFIGS
from engine_toy import Req, ToyModel, collect, hooks_for, run, toy_plan, wire_for

from tapc.api.requests import TapRequest
from tapc.api.session import TapSession
from tapc.cli import main
from tapc.errors import EngineError
from tapc.wire.arena import Arena, ArenaReader
from tapc.api.engine_args import engine_kwargs
from tapc.wire.config import EngineConfig

SEGMENT = 4096


def block(arena: Arena, fill: float) -> torch.Tensor:
    """A whole segment's block (1024 float32), filled with `fill`."""
    t = arena.tensor(1, 1, SEGMENT // 4, torch.float32)
    t.fill_(fill)
    return t


def files(arena: Arena) -> list[str]:
    return sorted(n for n in os.listdir(arena.directory) if n.startswith(arena.prefix))


def test_segments_grown_past_the_bound_go_back_once_idle_and_held_rows_stay(tmp_path):
    pinned, unpinned = [], []
    arena = Arena(directory=str(tmp_path), segment_bytes=SEGMENT, keep=SEGMENT,
                  register=lambda t: pinned.append(t.data_ptr()), unregister=lambda t: unpinned.append(t.data_ptr()))
    a, b, c = (block(arena, v) for v in (1.0, 2.0, 3.0))   # a burst: three segments, two past the bound
    assert arena.size == 3 * SEGMENT and len(files(arena)) == 3
    reader = ArenaReader()   # the API's side, reading c where the worker put it
    seen = reader.view(*arena.locate(c), (1, 1, SEGMENT // 4), torch.float32)
    with open(arena.path(1), "rb") as f:   # b's file, held open past its removal
        kept_open = os.dup(f.fileno())
    try:
        arena.give_back_tensor(b)
        assert files(arena) == sorted(os.path.basename(arena.path(s)) for s in (0, 2)), "b's segment went back"
        assert unpinned == [pinned[1]], "unpinned before its pages go"
        assert os.fstat(kept_open).st_blocks == 0, "its pages are freed though the file is still open"
    finally:
        os.close(kept_open)
    assert torch.all(a == 1.0) and torch.all(seen == 3.0), "the blocks still held keep their rows"
    arena.give_back_tensor(a)   # c's segment, held, now holds the bound alone: a's goes back too
    assert arena.size == SEGMENT and files(arena) == [os.path.basename(arena.path(2))]
    assert torch.all(seen == 3.0), "c, still held, is never freed"
    d = block(arena, 4.0)   # the next burst: a file of a new name, never an old one's
    assert arena.locate(d)[0] == arena.path(3)
    arena.give_back_tensor(c)
    arena.give_back_tensor(d)   # idle: back to the bound
    assert arena.size == SEGMENT and files(arena) == [os.path.basename(arena.path(3))] and len(unpinned) == 3
    arena.close()


def test_what_was_reserved_at_start_is_kept_and_no_bound_keeps_everything(tmp_path):
    bounded = Arena(directory=str(tmp_path), segment_bytes=SEGMENT, keep=0)
    bounded.reserve(2 * SEGMENT)
    t = bounded.tensor(2, 1, SEGMENT // 4, torch.float32)
    bounded.give_back_tensor(t)
    assert bounded.size == 2 * SEGMENT, "capture_memory_gib's reserve outlasts a smaller bound"
    grown = block(bounded, 1.0), block(bounded, 2.0), block(bounded, 3.0)
    for t in grown:
        bounded.give_back_tensor(t)
    assert bounded.size == 2 * SEGMENT
    bounded.close()
    unbounded = Arena(directory=str(tmp_path), segment_bytes=SEGMENT)
    for t in [block(unbounded, 1.0), block(unbounded, 2.0)]:
        unbounded.give_back_tensor(t)
    assert unbounded.size == 2 * SEGMENT and len(files(unbounded)) == 2, "the high-water mark, for the engine's life"
    unbounded.close()


def test_the_reader_unmaps_files_given_back_once_no_view_uses_them(tmp_path):
    arena = Arena(directory=str(tmp_path), segment_bytes=SEGMENT, keep=0)
    reader = ArenaReader()
    a, b = block(arena, 1.0), block(arena, 2.0)
    va = reader.view(*arena.locate(a), (SEGMENT // 4,), torch.float32)
    vb = reader.view(*arena.locate(b), (SEGMENT // 4,), torch.float32)
    path_a, path_b = arena.path(0), arena.path(1)
    del va
    gc.collect()
    for path, offset in reader.drain():
        arena.give_back(path, offset)
    assert not os.path.exists(path_a) and path_a in reader._maps
    c = block(arena, 3.0)   # a new file: the reader, mapping it, forgets the removed one nobody views
    assert torch.all(reader.view(*arena.locate(c), (SEGMENT // 4,), torch.float32) == 3.0)
    assert path_a not in reader._maps and path_b in reader._maps
    assert reader.where(vb) == (path_b, 0) and torch.all(vb == 2.0)
    arena.close()


def test_a_bounded_engine_gives_back_a_burst_and_keeps_the_captures_its_caller_holds():
    plan = toy_plan(["model.layers.*.resid"])
    runner, hooks = hooks_for(plan, ToyModel())
    hooks.arena.keep = 0   # the worker's `capture_keep`
    session = TapSession(plan)
    rng = np.random.default_rng(3)
    reqs = [Req(f"r{i}", rng.integers(0, 50, 12).tolist(), 4, wire_for(plan, TapRequest(capture="*"), f"r{i}"))
            for i in range(6)]
    run(runner, reqs, budget=64)
    outs = collect(hooks, reqs, session)
    grown = hooks.arena.size
    assert grown > 4096, "the burst grew the arena past a segment"
    kept = dict(outs.pop("r5").taps)
    want = {k: v.clone() for k, v in kept.items()}
    del outs
    gc.collect()
    hooks.release(session.arena.drain())
    assert 0 < hooks.arena.size < grown, "segments that hold no capture went back"
    assert all(torch.equal(kept[k], want[k]) for k in want), "the captures the caller holds are intact"
    del kept
    gc.collect()
    hooks.release(session.arena.drain())
    assert hooks.arena.size == 0 and not hooks.arena.held


def test_the_bound_reaches_the_workers_in_the_plans_config():
    plan = toy_plan(["model.layers.*.resid"])
    assert engine_kwargs(plan, {"capture_memory_keep_gib": 0.5})[1].capture_keep == 1 << 29
    assert engine_kwargs(plan, {"capture_memory_keep_gib": 0})[1].capture_keep == 0
    assert engine_kwargs(plan, {})[1].capture_keep is None, "no bound: all is kept"
    with pytest.raises(EngineError, match="capture_memory_keep_gib=-1: give the GiB"):
        engine_kwargs(plan, {"capture_memory_keep_gib": -1})


def test_tapc_serve_print_and_tapc_explain_report_the_bound(capsys, tmp_path):
    llama = str(CONFIGS / "llama")
    assert main(["serve", llama, "--tap", "model.layers.0.resid", "--capture-memory-keep-gib", "2", "--print"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert "--capture-memory-keep-gib" not in argv, "tapc's own setting, not vLLM's"
    assert EngineConfig.read(argv[argv.index("--additional-config") + 1]).capture_keep == 2 << 30
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent(f"""
        model: {llama}
        taps: [model.layers.0.resid]
        capture: {{memory_gib: 1, memory_keep_gib: 0.5}}
    """))
    assert main(["explain", str(spec)]) == 0
    assert ("host memory for captures: 1 GiB a GPU pinned at start (memory_gib); what it grows past 1 GiB goes "
            "back once no capture is held there (memory_keep_gib)") in capsys.readouterr().out
    spec.write_text(spec.read_text().replace(", memory_keep_gib: 0.5", ""))
    assert main(["explain", str(spec)]) == 0
    assert "all it grows to kept for the engine's life" in capsys.readouterr().out
