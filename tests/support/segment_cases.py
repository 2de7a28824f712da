"""What the segment copy tests (test_segmentcopy.py) and the driver binding tests
(test_memcpy.py) share: two requests' blocks in one pool, the check that they landed, and a
stream as copy_segments reads it. Not a test module."""
from types import SimpleNamespace as NS

import numpy as np
import torch

from tapc.worker.step import Segment
from tapc.worker.storage import Store


def cpu_alloc(rows, caps, width, dtype):
    return torch.zeros(rows, caps, width, dtype=dtype)


def segments_and_pool(device="cpu", alloc=cpu_alloc):
    """Two requests' blocks in one pool: 3 rows x 2 captures, then 1 row x 1 capture."""
    torch.manual_seed(0)
    pool = torch.randn(16, 5, device=device)
    a = Store(0, np.array([0, 1]), 5, torch.float32, alloc, first=4)
    b = Store(0, np.array([1]), 5, torch.float32, alloc, first=4)
    return [Segment(a, 0, 3), Segment(b, 6, 1)], pool, a, b


def copy_stream():
    """A stream as copy_segments reads it: its handle for the batch, and the one-by-one copies
    made under it (a real one where there is a GPU: entering a stand-in fails there)."""
    return torch.cuda.Stream() if torch.cuda.is_available() else NS(cuda_stream=1234)


def check(pool, a, b):
    torch.testing.assert_close(a.chunks[0][:3].reshape(6, 5).cpu(), pool[:6].cpu(), rtol=0, atol=0)
    torch.testing.assert_close(b.chunks[0][:1].reshape(1, 5).cpu(), pool[6:7].cpu(), rtol=0, atol=0)
