import time
from types import SimpleNamespace

import numpy as np

from mpifl.algorithms import Reduction
from mpifl.server import server as server_module
from mpifl.server.folding import FoldThreads
from mpifl.server.server import Server
from mpifl.transport.buffers import ReusedBuffer

SIZE = 3 * 1000 + 7  # float32 elements per upload


class Uploads:
    """Rank 0's side of the transport for _fold: fills each receive with its client's upload, and checks that no
    buffer it fills still holds an upload the fold has not taken."""

    def __init__(self, uploads, owner, folded):
        self.uploads, self.owner, self.folded = uploads, owner, folded
        self.next, self.windows, self.holding = 0, [], {}  # buffer address -> client it holds

    def receive(self, parts, sources, what):
        self.windows.append(len(parts))
        for part, source in zip(parts, sources):
            client = self.next
            assert self.owner[client] == source
            earlier = self.holding.get(part.__array_interface__["data"][0])
            assert earlier is None or self.folded() > earlier, f"client {client} overwrites unfolded {earlier}"
            np.frombuffer(part, np.float32)[:] = self.uploads[client]
            self.holding[part.__array_interface__["data"][0]] = client
            self.next += 1


def test_fold_receives_windows_into_two_buffers_and_folds_behind_to_the_sequential_bits(monkeypatch):
    """Seven clients on two ranks, windows of two uploads: every buffer is refilled only once its upload is
    folded, and the sums are the plain chain of additions in client-id order, on one thread or three, behind the
    receives or between them."""
    rng = np.random.default_rng(5)
    uploads = [(rng.standard_normal(SIZE) * 10.0 ** rng.integers(-6, 7, SIZE)).astype(np.float32) for _ in range(7)]
    coefficients = rng.uniform(-1, 1, 7)
    reference = np.zeros(SIZE)
    for c, x in zip(coefficients, uploads):
        reference += np.float64(c) * x.astype(np.float64)
    monkeypatch.setattr(server_module, "FOLD_WINDOW_BYTES", 2 * SIZE * 4 + 5)
    owner = {c: 1 + c % 2 for c in range(7)}
    plan = SimpleNamespace(uploads=tuple(range(7)),
                           work=(SimpleNamespace(uploads=(0, 2, 4, 6)), SimpleNamespace(uploads=(1, 3, 5))))
    messages = SimpleNamespace(summed=SimpleNamespace(nbytes=SIZE * 4,
                                                      unpack=lambda part: {"x": np.frombuffer(part, np.float32)}))
    made = []

    class Slow(server_module.Folding):  # the fold lags behind the receives: buffers are reused only once free
        def add(self, window):
            time.sleep(0.02)
            super().add(window)

    monkeypatch.setattr(server_module, "Folding", lambda *args: made.append(Slow(*args)) or made[-1])
    for threads, behind in ((1, True), (3, True), (1, False)):
        with FoldThreads(threads, behind) as folds:
            server = Server.__new__(Server)
            server.folds, server.fold_buffer, server.receiving_seconds = folds, ReusedBuffer(), 0.0
            server.session = SimpleNamespace(secure=None)  # no --secure-aggregation
            server.comm = comm = Uploads(uploads, owner, lambda: made[-1].folded)
            sums = server._fold(messages, plan, {"s": Reduction("x", coefficients)})
        assert comm.windows == [2, 2, 2, 1] and server.receiving_seconds > 0
        np.testing.assert_array_equal(sums["s"], reference)
