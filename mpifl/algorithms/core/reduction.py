"""Aggregation as a reduction: weighted sums of the clients' uploads, folded as they arrive.

Rank 0 never holds a round's uploads all at once.  A method states its aggregation as

1. :meth:`Algorithm.reductions`: the weighted sums sum_k c_k x_k it needs, each of one uploaded tensor
   (by default every uploaded model entry's weighted mean, c_k = w_k / sum_j w_j), computed from the
   round's plan before the clients train;
2. :meth:`Algorithm.prepare`: what it needs from every client's small tensors (the entries it names in
   :meth:`Algorithm.gathered_keys`, gathered whole) and the clients' records;
3. :meth:`Algorithm.aggregate`: the new global state from those sums (``Uploads.sums``).

While the clients train, the server receives the other uploaded tensors client by client, in client-id
order, and :class:`Folding` adds them into float64 sums, in the background (:class:`Behind`) while the next
upload arrives.  A method whose sums need what training returned (:attr:`Algorithm.reductions_need_results`:
FedNova's steps, FedDG-GA's gaps) runs 2 before 1, after the gather, and is folded then.  Every sum is
accumulated in client-id order, element by element exactly as a single pass over all uploads would
(:func:`weighted_sum`), so the result is bit for bit the same whoever hosts which client, however many arrive
at once and however many workers (:class:`~.fold_workers.FoldWorkers`: rank 0's thread and helper processes)
share the elements: rank-count invariance holds, and rank 0's memory is a few uploads plus the sums, whatever
the number of clients in the round.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .fold_workers import SERIAL, FoldWorkers


@dataclass(frozen=True)
class Reduction:
    """sum_k c_k x_k of the uploaded tensor ``upload`` over the round's clients (client-id order)."""

    upload: str
    coefficients: Sequence[float]  # (K,): one per client of the round, in client-id order


def mean_weights(weights: np.ndarray) -> np.ndarray:
    """The coefficients of a weighted mean, w_k / sum_j w_j (float64)."""
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


def _terms(values: Sequence[np.ndarray], coefficients: np.ndarray) -> list[tuple[float, np.ndarray]]:
    if not all(np.issubdtype(v.dtype, np.floating) for v in values):
        raise TypeError("only floating-point tensors can be summed")
    return [(c, np.ravel(x)) for c, x in zip(coefficients, values) if c]


class Folding:
    """Float64 running sums of ``reductions`` (by name), fed the round's uploads in client-id order, folded
    by ``workers`` (the sums in memory they share)."""

    def __init__(self, reductions: Mapping[str, Reduction], workers: FoldWorkers = SERIAL):
        self.reductions = dict(reductions)
        self.workers = workers
        self.sums: dict[str, np.ndarray] = {}
        self.folded = 0  # clients added so far

    def add(self, window: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Add the next ``len(window)`` clients, each a mapping from upload name to its tensor."""
        first, work = self.folded, []
        if not first:
            self.sums = self.workers.sums({name: np.shape(window[0][reduction.upload])
                                           for name, reduction in self.reductions.items()})
        for name, reduction in self.reductions.items():
            values = [uploads[reduction.upload] for uploads in window]
            coefficients = np.asarray(reduction.coefficients, dtype=np.float64)[first:first + len(window)]
            work.append((self.sums[name].reshape(-1), _terms(values, coefficients)))
        self.workers.fold(work, zero=not first)
        self.folded += len(window)


class Behind:
    """Folds the windows of uploads handed to it in client-id order, on the background thread of
    ``folding.workers`` while the caller receives the next ones (in the caller's thread where the workers do not
    fold ``behind``).  Each pass folds every upload handed over since the last pass as one window (each block of
    the sums is read once per window), so the sums are the chain of additions in client-id order."""

    def __init__(self, folding: Folding):
        self.folding = folding
        self._handed: list[Mapping[str, np.ndarray]] = []  # not folded yet
        self._running = False  # a pass is on the background thread
        self._failed: BaseException | None = None
        self._changed = threading.Condition()

    def hand(self, window: Sequence[Mapping[str, np.ndarray]]) -> None:
        """The next clients' uploads; they must stay as they are until :meth:`wait` says they are folded."""
        if not self.folding.workers.behind:
            self.folding.add(window)
            return
        with self._changed:
            self._handed += window
            if not self._running:
                self._running = True
                self.folding.workers.background(self._drain)

    def wait(self, clients: int) -> None:
        """Return once the first ``clients`` uploads handed over are folded; raise what the fold raised."""
        with self._changed:
            self._changed.wait_for(lambda: self._failed or self.folding.folded >= clients)
            if self._failed:
                raise self._failed

    def _drain(self) -> None:
        while True:
            with self._changed:
                window, self._handed = self._handed, []
                if not window or self._failed:
                    self._running = False
                    self._changed.notify_all()
                    return
            try:
                self.folding.add(window)
            except BaseException as exc:  # for wait() to raise in the caller's thread
                self._failed = exc
            with self._changed:
                self._changed.notify_all()


def weighted_mean(values: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """sum_k w_k x_k / sum_k w_k in float64, accumulated in client-id order (:func:`weighted_sum`)."""
    if len(weights) != len(values):
        raise ValueError(f"{len(weights)} weights for {len(values)} uploads")
    return weighted_sum(values, mean_weights(weights))


def weighted_sum(values: Sequence[np.ndarray], coefficients: Sequence[float],
                 out: np.ndarray | None = None, workers: FoldWorkers = SERIAL) -> np.ndarray:
    """``out`` + sum_k c_k x_k in float64 (``out`` None: a new zero sum), accumulated in client-id order;
    terms with c_k = 0 are skipped.

    A fixed order makes the result independent of which rank trained which client (rank-count
    invariance), and of how the clients are split into calls: each element's sum is the same chain of
    additions.  The sum runs block by block over the elements, every client's term of a block before the
    next block, so the partial sum never leaves the cache: each upload is read once and the result
    written once (3x faster than whole-array passes for a 50 MB model, with the same bits).  ``workers``
    share the blocks in runs of consecutive ones; an element's chain is the same whichever runs it.
    """
    terms = _terms(values, np.asarray(coefficients, dtype=np.float64))
    acc = workers.sums({"sum": np.shape(values[0])})["sum"] if out is None else out
    workers.fold([(acc.reshape(-1), terms)], zero=out is None)
    return acc
