"""bench_serve's `--timers`, on the CPU: the call timers wrap a module's functions when it is
imported, count only the main thread's calls, name targets that do not exist, and every target
they name exists in the installed vLLM; the report turns the servers' readings into ms a step.
The load itself needs a GPU (benchmarks/bench_serve.py)."""
import importlib
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_serve  # noqa: E402
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
        got = timers.window(before, timed.snapshot())
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, timers._Hook)]
        sys.modules.pop("tapc_timed_toy", None)
    assert got["calls"] == {"Work.step": 2}, "the other thread's call is not the engine thread's"
    assert 0.03 <= got["seconds"]["Work.step"] < 0.05
    assert got["missing"] == ["tapc_timed_toy:Work.gone"]


def test_every_target_exists_in_the_installed_vllm():
    for module, qualname in timers.TARGETS:
        owner, attr = qualname.rsplit(".", 1)
        assert callable(getattr(getattr(importlib.import_module(module), owner), attr)), f"{module}:{qualname}"


def reading(folder, process: str, seconds: dict, calls: dict, k: int):
    with open(os.path.join(folder, f"{process}-{k}.json"), "w") as f:
        json.dump({"process": process, "pid": k, "seconds": seconds, "calls": calls, "missing": []}, f)


def test_the_report_gives_each_servers_engine_ms_a_step(tmp_path):
    views = {}
    for name, sched in (("vanilla", 0.2), ("tapc", 0.3)):
        folder = tmp_path / name
        folder.mkdir()
        views[name] = bench_serve.CallTimes(str(folder))
        for k in range(2):   # two loads; the API server's reading is not the engine's
            reading(folder, "EngineCore", {"Scheduler.schedule": sched}, {"Scheduler.schedule": 100}, k)
            reading(folder, "MainProcess", {"Scheduler.schedule": 9.0}, {"Scheduler.schedule": 1}, 10 + k)
    lines = bench_serve.call_times_report(views, {"vanilla": 200, "tapc": 100}, {"vanilla": 1.0, "tapc": 1.0})
    assert "| (wall) | 5.000 | 10.000 | +5.000 | | |" in lines
    assert "| `Scheduler.schedule` | 2.000 | 6.000 | +4.000 | 1.00 | 2.00 |" in lines


def test_a_server_that_left_no_engine_reading_is_an_error(tmp_path):
    empty = bench_serve.CallTimes(str(tmp_path))
    try:
        empty.per_step(10)
    except RuntimeError as e:
        assert "no engine-core process left a reading" in str(e)
    else:
        raise AssertionError("an empty reading must not become a table of zeros")
