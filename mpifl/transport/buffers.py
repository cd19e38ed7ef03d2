"""Message buffers that recur every round, allocated once.

A round moves the same messages again and again: the download, each rank's
upload, the server's gather buffer.  Allocating them afresh costs more than
the bytes suggest: the kernel maps and zeroes every page on first touch (a
DigitModel gather is 300 MB, 75 000 page faults a round).  A
:class:`ReusedBuffer` keeps one allocation per message and hands out its
first ``nbytes``; it grows when a round needs more (partial participation
changes upload sizes) and never shrinks.
"""

from __future__ import annotations

import numpy as np
import torch

from .wire import Buffer


class ReusedBuffer:
    """One growable uint8 buffer.

    Host memory (a numpy array) by default; page-locked (``pinned``) for fast,
    asynchronous host<->GPU copies on a rank that trains on a GPU; or GPU
    memory (a torch tensor on ``device``) when the MPI library is CUDA-aware
    (:mod:`mpifl.transport.gpu_mpi`).
    """

    def __init__(self, pinned: bool = False, device: torch.device | None = None):
        self.pinned, self.device = pinned, device
        self._data: Buffer = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> Buffer:
        """A view of the buffer's first ``nbytes`` bytes; its content is whatever the last use left.
        Views handed out earlier share the memory: use one only until the next :meth:`get`."""
        if nbytes > self._data.nbytes:
            if self.device is not None:
                self._data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            else:
                self._data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned).numpy()
        return self._data[:nbytes]
