"""`VLLM.close()` and `with VLLM(...) as llm:` over the toy engine: vLLM's engine core is shut
down once, the workers' capture files go, captures already returned stay readable, and the
engine refuses work afterwards."""
import gc
import os

import pytest
import torch
from engine_toy import toy_vllm
from vllm import SamplingParams

from tapc.api.requests import TapRequest
from tapc.errors import EngineError


def _files(arena) -> list[str]:
    return [n for n in os.listdir(arena.directory) if n.startswith(arena.prefix)]


def test_close_stops_the_engine_once_and_frees_the_capture_files():
    llm, hooks = toy_vllm(["model.layers.*.resid"])
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3),
                       taps=TapRequest(capture="model.layers.1.resid"))[0]
    rows = out.taps["model.layers.1.resid"]
    want = rows.clone()
    assert _files(hooks.arena)
    llm.close()
    llm.close()   # again: nothing
    assert llm.llm.llm_engine.engine_core.shutdowns == 1 and llm.llm.rpcs.count("tapc_close") == 1
    assert not _files(hooks.arena), "the workers' capture files are removed at close"
    assert torch.equal(rows, want), "a capture already returned stays readable"
    with pytest.raises(EngineError, match="this engine was closed"):
        llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1))
    del rows, out
    gc.collect()


def test_an_engine_is_a_context_manager_that_closes_on_the_way_out():
    llm, hooks = toy_vllm(["model.layers.*.resid"])
    with pytest.raises(RuntimeError, match="the caller's"):
        with llm as same:
            assert same is llm
            same.generate([{"prompt_token_ids": [4, 5]}], SamplingParams(max_tokens=2),
                          taps=TapRequest(capture="*"))
            raise RuntimeError("the caller's")
    assert llm.closed and llm.llm.llm_engine.engine_core.shutdowns == 1 and not _files(hooks.arena)


def test_close_of_an_engine_whose_processes_died_still_shuts_it_down(monkeypatch):
    from vllm.v1.engine.exceptions import EngineDeadError

    llm, _ = toy_vllm(["model.layers.*.resid"])

    def dead(method, args=()):
        raise EngineDeadError()

    monkeypatch.setattr(llm.llm, "collective_rpc", dead)
    llm.close()
    assert llm.closed and llm.llm.llm_engine.engine_core.shutdowns == 1
