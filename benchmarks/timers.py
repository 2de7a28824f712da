"""Call timers on chosen functions of vLLM's engine loop: where the engine thread's wall time goes
a step, on any server alike (bench_serve.py's `--timers`, through serve_stacks/sitecustomize.py).

Each target is wrapped when its module is first imported (an import hook), before any instance
exists, so methods that vLLM binds at start (`EngineCore.step_fn`) are wrapped too. Only calls on
the process's main thread count (the engine core's loop runs there; the worker of a one-GPU
server runs on it). Times are inclusive: a target that calls another counts the other's time
too. Two clock reads a call, against a sampler's distortion of calls that let go of the GIL.
"""
import collections
import functools
import importlib.abc
import sys
import threading
import time

# (module, qualified name): the engine core's loop, the scheduler, the one-GPU executor and the
# V2 model runner of vLLM 0.26 (a target missing from the installed vLLM is reported as missing)
TARGETS = (
    ("vllm.v1.engine.core", "EngineCoreProc._process_input_queue"),   # waiting for work, and taking it in
    ("vllm.v1.engine.core", "EngineCoreProc._handle_client_request"),   # one request, abort or utility call
    ("vllm.v1.engine.core", "EngineCore.step_with_batch_queue"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor.execute_model"),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor.sample_tokens"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.add_requests"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.update_requests"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.prepare_inputs"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.prepare_attn"),
    # the forward: a FULL graph's replay, or the piecewise graphs' (attention between them)
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager.run_fullgraph"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "ModelCudaGraphManager.run_fullgraph"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager.run_pw_graph"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample"),
    ("vllm.v1.worker.gpu.async_utils", "AsyncOutput.get_output"),   # the wait for the GPU's step
)


class Timers:
    """Seconds and calls of each target on the main thread since the process started."""

    def __init__(self, targets=TARGETS):
        self.main = threading.get_ident()   # built at interpreter start, on the main thread
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.missing: list[str] = []
        self.pending: dict[str, list[str]] = collections.defaultdict(list)
        for module, qualname in targets:
            self.pending[module].append(qualname)
        for module in list(self.pending):
            if module in sys.modules:
                self._patch(sys.modules[module])
        sys.meta_path.insert(0, _Hook(self))

    def snapshot(self) -> dict:
        return {"seconds": dict(self.seconds), "calls": dict(self.calls), "missing": list(self.missing)}

    def _patch(self, module) -> None:
        for qualname in self.pending.pop(module.__name__, ()):
            owner_name, attr = qualname.rsplit(".", 1)
            owner = getattr(module, owner_name, None)
            fn = getattr(owner, attr, None)
            if fn is None:
                self.missing.append(f"{module.__name__}:{qualname}")
                continue
            setattr(owner, attr, self._wrap(fn, qualname))

    def _wrap(self, fn, name: str):
        main, seconds, calls, clock = self.main, self.seconds, self.calls, time.perf_counter

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if threading.get_ident() != main:
                return fn(*args, **kwargs)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += clock() - start
                calls[name] += 1
        return timed


class _Hook(importlib.abc.MetaPathFinder):
    """Runs the module as usual, then wraps its targets."""

    def __init__(self, timers: Timers):
        self.timers = timers

    def find_spec(self, name, path, target=None):
        if name not in self.timers.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run, timers = spec.loader.exec_module, self.timers

        def exec_module(module):
            run(module)
            timers._patch(module)
        spec.loader.exec_module = exec_module
        return spec


def window(before: dict, after: dict) -> dict:
    """What `after` added to `before` (plain data: it crosses processes)."""
    return {"seconds": {k: v - before["seconds"].get(k, 0.0) for k, v in after["seconds"].items()},
            "calls": {k: v - before["calls"].get(k, 0) for k, v in after["calls"].items()},
            "missing": after["missing"]}
