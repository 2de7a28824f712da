"""Tap ops patched into a forward (tapc/worker/install.py), compiled as vLLM compiles them.

vLLM traces the model with Dynamo and functionalizes it with auto_functionalized v1
(`enable_auto_functionalized_v2: False` in its compilation config): an op's written arguments
become copies that are written back after it. Two written arguments that are one buffer are
then written back one over the other; a capture op's row writes must survive that. The
`aot_eager` backend functionalizes as Inductor does, without a C++ compiler.
"""
from types import SimpleNamespace

import pytest
import torch


class Norm(torch.nn.Module):
    """A norm called with a residual, as vLLM's RMSNorm is after layer 0: (normed, h + residual)."""

    def forward(self, x, residual):
        h = x + residual
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), h


@pytest.mark.parametrize("pools", ["one pool", "two pools"])
def test_both_elements_of_a_calls_tuple_are_captured_in_a_compiled_forward(pools):
    """`output[0]` and `output[1]` of one call: into one pool (a norm's two tensors, one dtype and
    width) they run as two captures; into two (an MoE router's weights and ids) as one paired
    launch. Either way, compiled, every row lands where its table says."""
    import tapc.kernels  # noqa: F401  (registers torch.ops.tapc, as install() does)
    from tapc.worker.install import _Capture, _patch
    from tapc.plan.tapplan import Point

    norm = Norm()
    tables = {"d0": torch.tensor([0, 1, -1, 2], dtype=torch.int32), "d1": torch.tensor([3, -1, 4, 5], dtype=torch.int32),
              "p0": torch.full((6, 16), -7.0), "p1": torch.full((6, 16), -7.0)}
    for name, t in tables.items():
        norm.register_buffer(name, t, persistent=False)
    second = "p0" if pools == "one pool" else "p1"
    taps = [(SimpleNamespace(point=Point("norm", "output", element=k), width=16), _Capture(norm, dst, pool))
            for k, dst, pool in [(0, "d0", "p0"), (1, "d1", second)]]
    _patch(norm, "forward", "norm", taps)

    torch.manual_seed(0)
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    normed, h = Norm()(x, residual)
    with torch._inductor.config.patch(enable_auto_functionalized_v2=False):
        torch.compile(norm, backend="aot_eager", fullgraph=True)(x, residual)

    first, other = norm.p0, getattr(norm, second)
    assert torch.allclose(first[[0, 1, 2]], normed[[0, 1, 3]]), "output[0]'s rows"
    assert torch.allclose(other[[3, 4, 5]], h[[0, 2, 3]]), "output[1]'s rows"
    if pools == "two pools":
        assert (first[3:] == -7).all() and (other[:3] == -7).all(), "rows no table names stay as they were"
