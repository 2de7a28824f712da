"""Checkpoints and vLLM engines the GPU tests share, each made once per pytest session.

Not a test module: conftest.py imports its fixtures, so every module can ask for them. An
engine start costs about a minute (a spawned engine-core process, torch.compile, CUDA-graph
capture), so a configuration that several tests use is started once and kept until the
session ends (`engines`), the random checkpoints are written once (`checkpoints`) and
HF transformers loads each once (`hf_forward`).
Engines that one module or one test alone uses are built there and stopped with `shutdown`
when done.

Several engines are alive at once, in this process and, under pytest-xdist, in the other
workers' (`python3 -m pytest -m gpu tests -n 6 --dist loadgroup`: each worker has its own
session, so tests that share an engine are kept on one worker by `shares`; xdist's default
`--dist load` ignores the groups and starts such an engine on every worker that needs it). Each engine is given its KV cache
outright (`kv_cache_memory_bytes`, 256 MiB: 128K tokens of these 4-layer models), which skips
vLLM's memory profile: that profile reads the device's free memory, and fails or sizes the
cache wrongly when another process starts or stops an engine meanwhile. vLLM still refuses to
start when less than `gpu_memory_utilization` (0.1, about 14 GB of an H200) is free, far more
than an engine here uses. Engines are stopped explicitly (the core process has exited when
`shutdown` returns), never left to the garbage collector while the next one starts.

vLLM's own compile cache stays off (`VLLM_DISABLE_COMPILE_CACHE=1`): it is keyed by the whole
configuration, which no two engines of a session share, so it would never hit. Inductor's
and Triton's caches, keyed by the graphs' and kernels' contents, stay on and are shared by
every engine of the run (their default folders; set TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR
to move them), so what one engine compiled another can reuse.
"""
import contextlib
import functools
import gc
import os
import sys
from collections.abc import Callable

import pytest

# The small checkpoints are the examples' (examples/small_models.py): one writer for both.
from places import EXAMPLES

sys.path.insert(0, str(EXAMPLES))
from small_models import MLA, MOE, SMALL, write_checkpoint  # noqa: E402,F401

# max_num_seqs=3 and a 128-token budget force continuous batching. vLLM captures decode
# graphs for batch sizes up to twice max_num_seqs: [1, 2, 4] here, already a short list.
ENGINE = dict(max_num_seqs=3, max_num_batched_tokens=128, gpu_memory_utilization=0.1,
              kv_cache_memory_bytes=256 << 20, skip_tokenizer_init=True, max_model_len=1024, seed=0)
# The tapped engine of tests/api/test_engine_gpu.py, which tests/harvest/test_run_gpu.py shares.
CAPTURES = ["model.layers.*.resid", "model.layers.1.output[0]", "model.layers.2.mlp.down_proj.output"]
STEER = "model.layers.2.resid | add(steer, alpha=8.0)"


def shares(engine: str) -> pytest.MarkDecorator:
    """Mark tests that use the session engine named `engine` (an `Engines` name): under
    pytest-xdist (`--dist loadgroup`) they all run on one worker, which starts it once. Every
    other GPU test is grouped by its module (conftest.py), so module-scoped engines start once
    too."""
    return pytest.mark.xdist_group(engine)


def engine_env() -> None:
    """The environment every engine of the session starts with (inherited by its core process)."""
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    # torch.cuda.is_available() already touched the driver in this process: fork would give the
    # engine core a poisoned CUDA, so vLLM must spawn it.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def engine_args() -> dict:
    engine_env()
    return dict(ENGINE, attention_backend=os.environ.get("TAPC_ATTENTION_BACKEND"))


@contextlib.contextmanager
def environ(name: str, value: str | None):
    """`name` set to `value` (None: left as it is) inside, as it was after: an engine's processes
    inherit this process's environment as they start, so a variable for one engine is set only
    while it starts."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def importable(folder: str):
    """`folder` importable in the engine processes started inside, and only in those: on their
    PYTHONPATH, and on this process's `sys.path` while they start, because multiprocessing's
    spawn hands its child the parent's `sys.path` in place of the one PYTHONPATH gave it (vLLM's
    engine core would not see the folder otherwise)."""
    before = os.environ.get("PYTHONPATH")
    sys.path.insert(0, folder)
    try:
        with environ("PYTHONPATH", folder + (os.pathsep + before if before else "")):
            yield
    finally:
        sys.path.remove(folder)


def model_runner(kind: str):
    """Engines started inside run vLLM's `kind` model runner: "v2", vLLM 0.26's choice for dense
    models, or "v1" (VLLM_USE_V2_MODEL_RUNNER=0), the runner vLLM gives MoE models (the engine
    core reads the variable as it starts). A vLLM without the variable (0.34) has no V1 runner:
    "v1" skips there, rather than run V2 under V1's name."""
    if kind == "v1":
        import vllm
        from vllm import envs

        if "VLLM_USE_V2_MODEL_RUNNER" not in envs.environment_variables:
            pytest.skip(f"vLLM {vllm.__version__} has no V1 model runner")
    return environ("VLLM_USE_V2_MODEL_RUNNER", "0" if kind == "v1" else None)


@functools.cache
def hf_model(path: str):
    """HF transformers' model of a checkpoint on the GPU, loaded once (`hf_forward` runs it)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


def hf_forward(path: str, tokens: list[int], hooks: Callable = lambda model: []):
    """HF's output on `tokens` (one sequence). `hooks(model)` adds hooks for this run and returns
    their handles; they are removed afterwards, so the shared model stays as loaded."""
    import torch

    model = hf_model(path)
    handles = hooks(model)
    try:
        with torch.no_grad():
            return model(torch.tensor([tokens], device="cuda"))
    finally:
        for handle in handles:
            handle.remove()


def random_prompts(n: int, seed: int, shared: list[int] = ()) -> list[dict]:
    """`n` prompts of 20-89 random token ids of the small models' vocabulary, after `shared` (a
    prefix they all start with, e.g. for the prefix cache)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": list(shared) + rng.integers(0, SMALL["vocab_size"], int(m)).tolist()}
            for m in rng.integers(20, 90, n)]


def greedy(max_tokens: int):
    """Greedy sampling of exactly `max_tokens` tokens."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def shutdown(llm) -> None:
    """Stop an engine (a `tapc.VLLM` or a `vllm.LLM`) now: its core process exits and gives
    back its GPU memory before this returns (vLLM's `LLM` has no method for it: its core client's)."""
    from tapc.api.llm import VLLM

    if isinstance(llm, VLLM):
        llm.close()
    else:
        llm.llm_engine.engine_core.shutdown()
    gc.collect()


def llama_engine(taps: list[str]):
    """A module's `path` and `engine` fixtures: the session's Llama checkpoint, and one tapped
    engine on it with `taps`, stopped after the module. In the module: `path, engine = llama_engine(TAPS)`."""
    @pytest.fixture(scope="module")
    def path(checkpoints):
        return checkpoints("llama")

    @pytest.fixture(scope="module")
    def engine(path):
        from tapc import VLLM

        llm = VLLM(path, taps=taps, **engine_args())
        yield llm
        shutdown(llm)

    return path, engine


class Engines:
    """Engines by configuration name: started on first use, stopped at the session's end."""

    def __init__(self):
        self._started: dict[str, object] = {}

    def get(self, name: str, start: Callable[[], object]):
        if name not in self._started:
            self._started[name] = start()
        return self._started[name]

    def close(self) -> None:
        while self._started:
            shutdown(self._started.popitem()[1])


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch ("llama" | "qwen3" | "qwen3_moe" | "qwen2_moe" | "mixtral" | "deepseek_v2" | "deepseek_v3") -> the path of its random checkpoint,
    written on first use."""
    paths: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in paths:
            paths[arch] = write_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return paths[arch]

    return get


@pytest.fixture(scope="session")
def engines():
    started = Engines()
    yield started
    started.close()


@pytest.fixture(scope="session")
def tapped_engine(engines, checkpoints):
    """(arch, runner) -> the engine with CAPTURES and STEER on that arch's checkpoint, on vLLM's
    `runner` ("v2" or "v1", `model_runner`)."""
    def get(arch: str, runner: str = "v2"):
        from tapc import VLLM

        def start():
            with model_runner(runner):
                return VLLM(checkpoints(arch), taps=CAPTURES + [STEER], **engine_args())

        return engines.get(f"tapped {arch} {runner}", start)

    return get


@pytest.fixture(scope="session")
def vanilla_llama(engines, checkpoints):
    """vLLM with no taps on the Llama checkpoint."""
    def start():
        from vllm import LLM

        return LLM(checkpoints("llama"), **engine_args())

    return engines.get("vanilla llama", start)
