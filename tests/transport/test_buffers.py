import numpy as np
import torch

from mpifl.transport.buffers import ReusedBuffer


def test_a_reused_buffer_hands_out_the_same_memory_and_grows_only_when_asked_for_more():
    buffer = ReusedBuffer()
    first = buffer.get(100)
    assert first.nbytes == 100 and first.dtype == np.uint8
    first[:] = 7
    smaller = buffer.get(40)
    assert smaller.nbytes == 40 and np.shares_memory(smaller, first) and (smaller == 7).all()
    larger = buffer.get(1000)
    assert larger.nbytes == 1000 and not np.shares_memory(larger, first)
    assert np.shares_memory(buffer.get(100), larger)


def test_a_buffer_on_a_device_is_a_tensor_there():
    buffer = ReusedBuffer(device=torch.device("cpu"))  # a GPU in production: the same code path
    view = buffer.get(64)
    assert isinstance(view, torch.Tensor) and view.dtype == torch.uint8 and view.numel() == 64
    assert buffer.get(32).data_ptr() == view.data_ptr()
