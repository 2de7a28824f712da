"""Call timers on chosen functions of vLLM's engine loop: where the engine thread's wall time goes
a step, on any server alike (bench_serve.py's `--timers`, through serve_stacks/sitecustomize.py).

Each target is wrapped when its module is first imported (an import hook), before any instance
exists, so methods that vLLM binds at start (`EngineCore.step_fn`) are wrapped too. Only calls on
the process's main thread count (the engine core's loop runs there; the worker of a one-GPU
server runs on it). Times are inclusive: a target that calls another counts the other's time
too. Two clock reads a call, against a sampler's distortion of calls that let go of the GIL.
Beside them, two CUDA events a step give the GPU's side (`GpuSpans`): where the GPU is busy the
engine thread waits for it somewhere in its functions, and the events say how long.
"""
import collections
import functools
import gc
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
    # the rest of the V2 runner's execute_model (module-level functions by their plain names)
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.finish_requests"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.free_states"),
    ("vllm.v1.worker.gpu.model_runner", "dispatch_cg_and_sync_dp"),
    ("vllm.v1.worker.gpu.model_runner", "build_slot_mappings_by_layer"),
    ("vllm.v1.worker.gpu.block_table", "BlockTables.apply_staged_writes"),
    ("vllm.v1.worker.gpu.model_states.default", "DefaultModelState.prepare_inputs"),
    ("vllm.v1.worker.gpu.model_states.default", "DefaultModelState.prepare_attn"),
    # every CUDA graph launch (vLLM's FULL and piecewise graphs alike), and tapc's switch over them
    ("torch.cuda.graphs", "CUDAGraph.replay"),
    ("tapc.worker.switch", "SwitchedGraph.replay"),
    ("tapc.worker.switch", "SwitchedGraph._set"),
    # the layers between the executor and the runner (tapc's adapter replaces the runner's method
    # on the instance, and calls the class's)
    ("vllm.v1.worker.gpu_worker", "Worker.execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model"),
)

# The GPU's side of a step, from CUDA events the engine thread records on its current stream: one
# as `execute_model` is entered (the GPU reaches it once the step before is done, or at once when
# it idles), one as `sample_tokens` returns (after the step's sampling).
GPU_START, GPU_STOP = "UniProcExecutor.execute_model", "UniProcExecutor.sample_tokens"
GPU_STEP, GPU_IDLE = "(GPU) execute_model to sample_tokens", "(GPU) idle between steps"
# A step the host began this long after it marked the last one's end was waiting for work (before
# a load, between bursts): the GPU's idle before it is not counted.
IDLE_CUT_S = 0.05


class Timers:
    """Seconds and calls of each target on the main thread since the process started."""

    def __init__(self, targets=TARGETS):
        self.main = threading.get_ident()   # built at interpreter start, on the main thread
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.missing: list[str] = []
        # the main thread's calls in progress: name -> their start times. A snapshot counts each
        # one's time so far, so a window's difference holds only the part inside it: a wait for
        # work that began before a load (`_process_input_queue`, idle while the other server's
        # load ran) read 10-18 ms a step when counted whole when it ended.
        self.running: dict[str, list[float]] = collections.defaultdict(list)
        self.gpu = GpuSpans(self.seconds, self.calls)
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)
        self.pending: dict[str, list[str]] = collections.defaultdict(list)
        for module, qualname in targets:
            self.pending[module].append(qualname)
        for module in list(self.pending):
            if module in sys.modules:
                self._patch(sys.modules[module])
        sys.meta_path.insert(0, _Hook(self))

    def snapshot(self) -> dict:
        """Seconds (of finished calls, and of the calls in progress so far) and calls (finished)."""
        now = time.perf_counter()
        seconds = collections.Counter(self.seconds)
        for name, starts in list(self.running.items()):
            seconds[name] += sum(now - t for t in list(starts))
        return {"seconds": dict(seconds), "calls": dict(self.calls), "missing": list(self.missing)}

    def _gc(self, phase: str, info: dict) -> None:
        """Python's garbage collections on the main thread, by generation (they run inside
        whichever function allocated, so their time is in its figure too)."""
        if threading.get_ident() != self.main:
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            name = f"(gc) generation {info['generation']}"
            self.seconds[name] += time.perf_counter() - self._gc_start
            self.calls[name] += 1

    def _patch(self, module) -> None:
        for qualname in self.pending.pop(module.__name__, ()):
            owner_name, _, attr = qualname.rpartition(".")
            owner = getattr(module, owner_name, None) if owner_name else module
            fn = getattr(owner, attr, None)
            if fn is None:
                self.missing.append(f"{module.__name__}:{qualname}")
                continue
            setattr(owner, attr, self._wrap(fn, qualname))

    def _wrap(self, fn, name: str):
        main, seconds, calls, clock = self.main, self.seconds, self.calls, time.perf_counter
        running = self.running[name]
        before = self.gpu.start if name == GPU_START else None
        after = self.gpu.stop if name == GPU_STOP else None

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if threading.get_ident() != main:
                return fn(*args, **kwargs)
            start = clock()
            running.append(start)
            if before is not None:
                before()
            try:
                return fn(*args, **kwargs)
            finally:
                if after is not None:
                    after()
                running.pop()
                seconds[name] += clock() - start
                calls[name] += 1
        return timed


class GpuSpans:
    """The GPU's time from each step's start mark to its stop mark (GPU_STEP) and from one step's
    stop to the next one's start (GPU_IDLE: the GPU waited for the host), read from CUDA timing
    events once the GPU has passed them (`query`: no wait). Without CUDA the marks do nothing."""

    def __init__(self, seconds, calls):
        self.seconds, self.calls = seconds, calls
        self.open = None                          # the step's start event, until its stop
        # (start, whether the host began the step within IDLE_CUT_S of the last, stop) not yet passed
        self.pending: collections.deque = collections.deque()
        self.last_stop = None
        self.host_stop = 0.0                      # when the host marked the last step's end

    def start(self) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.open = (self._record(torch), time.perf_counter() - self.host_stop < IDLE_CUT_S)

    def stop(self) -> None:
        import torch

        if self.open is None:   # a step without a start mark (or before CUDA was up)
            return
        self.pending.append((*self.open, self._record(torch)))
        self.open = None
        self.host_stop = time.perf_counter()
        while self.pending and self.pending[0][2].query():
            begin, busy, end = self.pending.popleft()
            self.seconds[GPU_STEP] += begin.elapsed_time(end) / 1e3
            self.calls[GPU_STEP] += 1
            if self.last_stop is not None and busy:
                self.seconds[GPU_IDLE] += max(self.last_stop.elapsed_time(begin), 0.0) / 1e3
                self.calls[GPU_IDLE] += 1
            self.last_stop = end

    @staticmethod
    def _record(torch):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


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
