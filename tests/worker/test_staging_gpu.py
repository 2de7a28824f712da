"""Parameter rows go up through two halves of pinned memory (tapc/worker/buffers.py `Staging`): rows
written while the device is still busy with earlier work, through several turns of both halves,
each land in their place with their own values."""
import numpy as np
import pytest
import torch

from tapc.worker.buffers import Staging

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_rows_put_through_several_turns_of_the_halves_while_the_device_is_busy_all_land():
    dev = torch.device("cuda")
    staging = Staging(dev)
    rng = np.random.default_rng(0)
    vectors = torch.zeros(1500, 4096, dtype=torch.float32, device=dev)   # 1500 x 16 KiB: about six halves
    ids = torch.zeros(1500, 37, dtype=torch.int32, device=dev)
    scalars = torch.zeros(1500, dtype=torch.float32, device=dev)
    big = torch.zeros(Staging.HALF // 4 + 1, dtype=torch.float32, device=dev)   # larger than a half
    want_v = rng.standard_normal((1500, 4096)).astype(np.float32)
    want_i = rng.integers(-1, 1 << 20, size=(1500, 37)).astype(np.int32)
    want_s = rng.standard_normal(1500).astype(np.float32)
    want_big = rng.standard_normal(big.shape[0]).astype(np.float32)
    torch.cuda._sleep(200_000_000)   # the stream is busy: the copies queue behind it
    for k in range(1500):
        staging.put(vectors[k], want_v[k])
        staging.put(ids[k], want_i[k])
        staging.put(scalars[k], np.asarray(want_s[k]))   # 0-d, as slot_row makes a scalar
        if k == 700:
            staging.put(big, want_big)
    torch.cuda.synchronize()
    assert staging.side == 1 or staging.left[0] is not None, "the halves never turned"
    np.testing.assert_array_equal(vectors.cpu().numpy(), want_v)
    np.testing.assert_array_equal(ids.cpu().numpy(), want_i)
    np.testing.assert_array_equal(scalars.cpu().numpy(), want_s)
    np.testing.assert_array_equal(big.cpu().numpy(), want_big)
