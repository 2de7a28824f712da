"""bench_serve's readings of each server's processes during its loads (serve_stacks/
sitecustomize.py, readings.py): the call timers (timers.py) wrap a module's functions (methods and
module-level functions) when it is imported, count only the main thread's calls and Python's
collections, name targets that do not exist, and every target they name exists in the installed
vLLM; the GPU marks read each step's GPU time and the GPU's idle time between steps, and the
device timer (devicetime.py) each kernel's GPU time (both on the GPU); the reports turn the
servers' readings into ms a step, each mix apart. The load itself needs a GPU
(benchmarks/bench_serve.py)."""
import collections
import contextlib
import gc
import importlib
import json
import os
import sys
import threading
import time

import pytest
from places import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import readings  # noqa: E402
import timers  # noqa: E402

MODULE = '''
import time

class Work:
    def step(self, seconds):
        time.sleep(seconds)
        return seconds

    def inner(self):
        return 1
'''


def test_a_module_imported_later_is_timed_on_the_main_thread_only(tmp_path, monkeypatch):
    (tmp_path / "tapc_timed_toy.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    timed = timers.Timers([("tapc_timed_toy", "Work.step"), ("tapc_timed_toy", "Work.gone")])
    try:
        before = timed.snapshot()
        toy = importlib.import_module("tapc_timed_toy")
        work = toy.Work()
        assert work.step(0.02) == 0.02 and work.step(0.01) == 0.01   # wrapped, answers unchanged
        other = threading.Thread(target=work.step, args=(0.05,))
        other.start()
        other.join()
        work.inner()
        gc.collect()   # a full collection on the main thread, timed by generation
        got = timers.window(before, timed.snapshot())
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, timers._Hook)]
        sys.modules.pop("tapc_timed_toy", None)
    assert got["calls"].pop("(gc) generation 2") >= 1
    assert {k: n for k, n in got["calls"].items() if not k.startswith("(gc)")} == {"Work.step": 2}, \
        "the other thread's call is not the engine thread's"
    assert 0.03 <= got["seconds"]["Work.step"] < 0.05
    assert got["missing"] == ["tapc_timed_toy:Work.gone"]


def test_a_window_holds_only_the_part_of_a_call_inside_it(tmp_path, monkeypatch):
    """A call that began before a window opened (an engine waiting for work while the other
    server's load ran) counts from the window's start: snapshots count calls in progress so far."""
    (tmp_path / "tapc_timed_span.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    timed = timers.Timers([("tapc_timed_span", "Work.step")])
    try:
        work = importlib.import_module("tapc_timed_span").Work()
        taken = []
        opener = threading.Timer(0.15, lambda: taken.append(timed.snapshot()))   # opens mid-call
        opener.start()
        work.step(0.25)
        opener.join()
        got = timers.window(taken[0], timed.snapshot())
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, timers._Hook)]
        sys.modules.pop("tapc_timed_span", None)
    assert 0.07 <= got["seconds"]["Work.step"] <= 0.15, got   # about 0.1 of its 0.25 s
    assert got["calls"]["Work.step"] == 1


def test_every_target_exists_in_the_installed_vllm():
    for module, qualname in timers.TARGETS:
        owner, _, attr = qualname.rpartition(".")
        where = importlib.import_module(module)
        assert callable(getattr(getattr(where, owner) if owner else where, attr)), f"{module}:{qualname}"


def test_a_module_level_function_is_timed_where_its_callers_look_it_up(tmp_path, monkeypatch):
    (tmp_path / "tapc_timed_fn.py").write_text("import time\n\ndef work(s):\n    time.sleep(s)\n    return s\n\n"
                                               "def caller():\n    return work(0.01)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    timed = timers.Timers([("tapc_timed_fn", "work")])
    try:
        before = timed.snapshot()
        assert importlib.import_module("tapc_timed_fn").caller() == 0.01
        got = timers.window(before, timed.snapshot())
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, timers._Hook)]
        sys.modules.pop("tapc_timed_fn", None)
    assert got["calls"]["work"] == 1 and 0.01 <= got["seconds"]["work"] < 0.05


@pytest.mark.gpu
def test_the_gpu_marks_read_each_steps_gpu_time_and_the_idle_between():
    import torch

    torch.cuda.init()
    seconds, calls = collections.Counter(), collections.Counter()
    spans = timers.GpuSpans(seconds, calls)
    own = []
    for _ in range(4):   # steps of a known GPU time each, the host idling the GPU 20 ms between
        spans.start()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        own.append((a, b))
        spans.stop()
        torch.cuda.synchronize()
        time.sleep(0.02)
    # a step is read at a later step's stop, once the GPU has passed it: the last one is not yet
    assert calls[timers.GPU_STEP] == 3 and calls[timers.GPU_IDLE] == 2
    slept = sum(a.elapsed_time(b) for a, b in own[:3]) / 1e3
    assert slept <= seconds[timers.GPU_STEP] < slept + 0.003
    assert 0.04 <= seconds[timers.GPU_IDLE] < 0.1     # the host's 20 ms sleeps (and a sync) each time


def reading(folder, process: str, seconds: dict, calls: dict, k: int):
    with open(os.path.join(folder, f"{process}-{k}.json"), "w") as f:
        json.dump({"process": process, "pid": k, "seconds": seconds, "calls": calls, "missing": []}, f)


def test_the_report_gives_each_servers_engine_ms_a_step_for_each_mix_apart(tmp_path):
    views = {}
    for name, sched in (("vanilla", 0.2), ("tapc", 0.3)):
        folder = tmp_path / name
        folder.mkdir()
        window = readings.CallTimes(str(folder))
        # the first mix's load, set aside before the second mix's
        reading(folder, "EngineCore", {"Scheduler.schedule": 5.0}, {"Scheduler.schedule": 7}, 99)
        first = window.set_aside("mix0")
        assert [r["seconds"] for r in first.readings()] == [{"Scheduler.schedule": 5.0}]
        for k in range(2):   # two loads; the API server's reading is not the engine's
            reading(folder, "EngineCore", {"Scheduler.schedule": sched}, {"Scheduler.schedule": 100}, k)
            reading(folder, "MainProcess", {"Scheduler.schedule": 9.0}, {"Scheduler.schedule": 1}, 10 + k)
        views[name] = window.set_aside("mix1")
    lines = readings.call_times_report(views, {"vanilla": 200, "tapc": 100}, {"vanilla": 1.0, "tapc": 1.0},
                                          "0.4,0.6,0,0")
    assert lines[0].startswith("# bench_serve --timers, mix 0.4,0.6,0,0:")
    assert "| (wall) | 5.000 | 10.000 | +5.000 | | |" in lines
    assert "| `Scheduler.schedule` | 2.000 | 6.000 | +4.000 | 1.00 | 2.00 |" in lines


def test_a_server_that_left_no_engine_reading_is_an_error(tmp_path):
    empty = readings.CallTimes(str(tmp_path))
    try:
        empty.per_step(10)
    except RuntimeError as e:
        assert "no engine-core process left a reading" in str(e)
    else:
        raise AssertionError("an empty reading must not become a table of zeros")


def test_the_kernel_report_gives_each_servers_gpu_ms_a_step_by_kernel(tmp_path):
    views = {}
    for name, kernels in (("vanilla", {"gemm": [200, 2000.0], "Memcpy HtoD (Pinned -> Device)": [100, 100.0]}),
                          ("tapc", {"gemm": [200, 2600.0], "Memcpy HtoD (Pinned -> Device)": [100, 150.0],
                                    "_capture_kernel": [50, 300.0]})):
        folder = tmp_path / name
        folder.mkdir()
        for k, got in enumerate((kernels, {})):   # the API server's process records none
            with open(folder / f"p-{k}.json", "w") as f:
                json.dump({"process": "EngineCore" if k == 0 else "MainProcess", "pid": k, "kernels": got}, f)
        views[name] = readings.Kernels(str(folder))
    lines = readings.kernels_report(views, {"vanilla": 100, "tapc": 50}, "1,0,0,0")
    assert lines[0].startswith("# bench_serve --kernels, mix 1,0,0,0:")
    assert "| kernels | 0.020 | 0.058 | +0.038 | 2.0 | 5.0 |" in lines
    assert "| copies and memsets | 0.001 | 0.003 | +0.002 | 1.0 | 2.0 |" in lines
    assert "| tapc's kernels | 0.000 | 0.006 | +0.006 | 0.0 | 1.0 |" in lines
    at = lines.index("| kernel or copy | vanilla ms a step | tapc ms a step | tapc - vanilla | vanilla launches a step "
                     "| tapc launches a step |")
    assert lines[at + 2] == "| `gemm` | 0.020 | 0.052 | +0.032 | 2.00 | 4.00 |"   # the largest difference first


def test_a_server_that_recorded_no_kernel_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="no process recorded a kernel"):
        readings.Kernels(str(tmp_path)).summed()


@pytest.mark.gpu
def test_the_device_timer_records_each_kernel_by_name_with_its_gpu_time():
    import torch
    from devicetime import DeviceTimer

    torch.cuda.init()
    torch.cuda._sleep(1_000)   # finished before the timer starts: not counted
    torch.cuda.synchronize()
    timer = DeviceTimer()
    for _ in range(3):
        torch.cuda._sleep(5_000_000)
    torch.cuda.synchronize()
    got = timer.stop()
    # torch.cuda._sleep launches ATen's `spin_kernel`. Only the launches and that a GPU time is
    # read are checked: how long the kernels took depends on what else shares the GPU (timings
    # are the benchmarks' job).
    (name, (count, us)), = [(k, v) for k, v in got.items() if "spin_kernel" in k]
    assert count == 3
    assert us > 0


def test_each_process_of_a_server_leaves_its_readings_of_a_load(tmp_path):
    """serve_stacks/sitecustomize.py in a process started as bench_serve starts a server's: the
    load's window (the file `on`) gives a call-timer reading and a kernel reading (none recorded
    in a process without a GPU context)."""
    import subprocess

    here = str(ROOT / "benchmarks" / "serve_stacks")
    folders = {env: tmp_path / env for env in ("TAPC_TIMERS_DIR", "TAPC_KERNELS_DIR")}
    for folder in folders.values():
        folder.mkdir()
    env = {**os.environ, **{k: str(v) for k, v in folders.items()},
           "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(4)"], env=env)
    try:
        time.sleep(1.0)
        with contextlib.ExitStack() as load:   # a load's window on both readings, as bench_serve opens them
            for folder in folders.values():
                load.enter_context(readings.Window(str(folder)))
            time.sleep(0.5)
        # once the windows are closed, every reading is in (none is still being written)
        assert all(list(f.glob("*.json")) and not list(f.glob("*.open")) for f in folders.values())
    finally:
        child.wait(10)
    (timed,) = [json.loads(p.read_text()) for p in folders["TAPC_TIMERS_DIR"].glob("*.json")]
    (kernels,) = [json.loads(p.read_text()) for p in folders["TAPC_KERNELS_DIR"].glob("*.json")]
    assert timed["process"] == kernels["process"] == "MainProcess"
    assert set(timed) >= {"seconds", "calls", "missing"} and kernels["kernels"] == {}
