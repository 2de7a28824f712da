"""Stack samples of every Python process of a server that bench_serve.py starts with `--profile`.

Python imports this module at start in every process whose PYTHONPATH holds this folder (the
API server, vLLM's engine core, anything they spawn). With TAPC_STACKS_DIR set, a thread waits
for the file `on` there, samples the process's stacks (stacks.py) while it exists, and when it
goes writes the window's samples to `<process name>-<pid>-<window>.json` in that folder. Without
TAPC_STACKS_DIR it does nothing.
"""
import os

_DIR = os.environ.get("TAPC_STACKS_DIR")


def _watch(folder: str, interval: float) -> None:
    import json
    import multiprocessing
    import time

    from stacks import Sampler

    flag, window = os.path.join(folder, "on"), 0
    while True:
        while not os.path.exists(flag):
            time.sleep(0.05)
        sampler = Sampler(interval)
        while os.path.exists(flag):
            time.sleep(0.05)
        threads = sampler.stop()
        name = multiprocessing.current_process().name
        path = os.path.join(folder, f"{name}-{os.getpid()}-{window}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"process": name, "pid": os.getpid(), "threads": threads}, f)
        os.replace(path + ".tmp", path)   # whole or absent: the bench reads as soon as it appears
        window += 1


if _DIR:
    import sys
    import threading

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/
    threading.Thread(target=_watch, args=(_DIR, float(os.environ.get("TAPC_STACKS_INTERVAL", "0.002"))),
                     name="tapc-stacks", daemon=True).start()
