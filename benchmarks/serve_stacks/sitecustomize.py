"""Per-load readings of every Python process of a server that bench_serve.py starts with
`--profile` (stack samples, stacks.py), `--timers` (call timers on vLLM's engine loop, timers.py)
or `--kernels` (the GPU's kernel and copy times, devicetime.py).

Python imports this module at start in every process whose PYTHONPATH holds this folder (the
API server, vLLM's engine core, anything they spawn). With TAPC_STACKS_DIR, TAPC_TIMERS_DIR or TAPC_KERNELS_DIR
set, a thread waits for the file `on` there, reads while it exists, and when it goes writes the
window's reading to `<process name>-<pid>-<window>.json` in that folder. Without them it does
nothing.
"""
import os


def _watch(folder: str, start) -> None:
    """`start()` begins a window's reading and returns the call that ends it with plain data."""
    import json
    import multiprocessing
    import time

    flag, window = os.path.join(folder, "on"), 0
    while True:
        while not os.path.exists(flag):
            time.sleep(0.05)
        name = multiprocessing.current_process().name
        path = os.path.join(folder, f"{name}-{os.getpid()}-{window}.json")
        open(path + ".open", "w").close()   # a reading under way: the bench waits for it (readings.Window)
        stop = start()
        while os.path.exists(flag):
            time.sleep(0.05)
        reading = stop()
        with open(path + ".tmp", "w") as f:
            json.dump({"process": name, "pid": os.getpid(), **reading}, f)
        os.replace(path + ".tmp", path)   # whole or absent
        os.remove(path + ".open")
        window += 1


def _stacks():
    from stacks import Sampler

    sampler = Sampler(float(os.environ.get("TAPC_STACKS_INTERVAL", "0.002")))
    return lambda: {"threads": sampler.stop()}


def _kernels():
    """CUPTI's kernel records in a process that has a GPU context (the engine core's), none else."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return lambda: {"kernels": {}}
    from devicetime import DeviceTimer

    timer = DeviceTimer()
    return lambda: {"kernels": timer.stop()}


def _timer_window(timers):
    from timers import window

    before = timers.snapshot()
    return lambda: window(before, timers.snapshot())


if os.environ.get("TAPC_STACKS_DIR") or os.environ.get("TAPC_TIMERS_DIR") or os.environ.get("TAPC_KERNELS_DIR"):
    import sys
    import threading

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/
    if os.environ.get("TAPC_STACKS_DIR"):
        threading.Thread(target=_watch, args=(os.environ["TAPC_STACKS_DIR"], _stacks),
                         name="tapc-stacks", daemon=True).start()
    if os.environ.get("TAPC_KERNELS_DIR"):
        threading.Thread(target=_watch, args=(os.environ["TAPC_KERNELS_DIR"], _kernels),
                         name="tapc-kernels", daemon=True).start()
    if os.environ.get("TAPC_TIMERS_DIR"):
        from timers import Timers

        _timers = Timers()   # now, on the main thread, before vLLM is imported
        threading.Thread(target=_watch, args=(os.environ["TAPC_TIMERS_DIR"], lambda: _timer_window(_timers)),
                         name="tapc-timers", daemon=True).start()
