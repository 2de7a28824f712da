"""The worker's runner adapters follow the installed vLLM: 0.26 has a V2 and a V1 model runner,
0.34 only V2 (no `vllm/v1/worker/gpu_model_runner.py`), and its config no `uses_xdrope_dim`."""
import importlib
import sys
from types import SimpleNamespace as NS

import pytest
import torch

from tapc.errors import EngineError
from tapc.worker.runner import row_positions
from tapc.worker.runner_v2 import V2Adapter


def _runner(cls):
    """An instance of vLLM's runner class, not built (the adapter choice reads only its class)."""
    return object.__new__(cls)


def test_each_runner_gets_its_adapter():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    from tapc.worker.runner_v1 import V1Adapter
    from tapc.worker.worker import ADAPTERS, runner_adapter

    assert ADAPTERS == (V2Adapter, V1Adapter)
    assert runner_adapter(_runner(V2Runner)) is V2Adapter
    assert runner_adapter(_runner(V1Runner)) is V1Adapter


def test_without_vllms_v1_runner_the_worker_imports_and_takes_v2_only(monkeypatch):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    import tapc.worker.worker

    # As on vLLM 0.34: importing the V1 runner's module raises ImportError. The worker's module
    # is imported afresh; the one the other tests use is put back after.
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)
    monkeypatch.delitem(sys.modules, "tapc.worker.worker")
    monkeypatch.delitem(sys.modules, "tapc.worker.runner_v1", raising=False)
    monkeypatch.setattr(tapc.worker, "worker", tapc.worker.worker)
    with pytest.raises(ImportError):
        importlib.import_module("vllm.v1.worker.gpu_model_runner")
    worker = importlib.import_module("tapc.worker.worker")

    assert worker.ADAPTERS == (V2Adapter,)
    assert "tapc.worker.runner_v1" not in sys.modules
    assert worker.runner_adapter(_runner(V2Runner)) is V2Adapter
    with pytest.raises(EngineError) as refused:
        worker.runner_adapter(_runner(V1Runner))
    assert str(refused.value) == ("tapc instruments vLLM's V2 (vllm/v1/worker/gpu/) model runner, but this engine "
                                  "runs vllm.v1.worker.gpu_model_runner.GPUModelRunner")


def test_positions_without_xdrope_in_the_config():
    """vLLM 0.34's ModelConfig has `uses_mrope` and no `uses_xdrope_dim` (XD-RoPE is read as M-RoPE)."""
    positions = torch.arange(8)
    assert row_positions(NS(uses_mrope=False), positions) is positions
    assert row_positions(NS(uses_mrope=True), positions) is None
    assert row_positions(NS(uses_mrope=False, uses_xdrope_dim=2), positions) is None
