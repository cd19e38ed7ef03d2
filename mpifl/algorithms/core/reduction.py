"""Aggregation as a reduction: weighted sums of the clients' uploads, folded as they arrive.

Rank 0 never holds a round's uploads all at once.  A method states its aggregation as

1. :meth:`Algorithm.reductions`: the weighted sums sum_k c_k x_k it needs, each of one uploaded tensor
   (by default every uploaded model entry's weighted mean, c_k = w_k / sum_j w_j), computed from the
   round's plan before the clients train;
2. :meth:`Algorithm.prepare`: what it needs from every client's small tensors (the entries it names in
   :meth:`Algorithm.gathered_keys`, gathered whole) and the clients' records;
3. :meth:`Algorithm.aggregate`: the new global state from those sums (``Uploads.sums``).

While the clients train, the server (:mod:`mpifl.server.folding`) receives the other uploaded tensors client by
client, in client-id order, and adds them into float64 sums with this module's kernel (:func:`fold_ranges`).  A
method whose sums need what training returned (:attr:`Algorithm.reductions_need_results`: FedNova's steps,
FedDG-GA's gaps) runs 2 before 1, after the gather, and is folded then.  Every sum is accumulated in client-id
order, element by element exactly as a single pass over all uploads would (:func:`weighted_sum`), so the result is
bit for bit the same whoever hosts which client, however many arrive at once and however the elements are shared
among threads: rank-count invariance holds, and rank 0's memory is a few uploads plus the sums, whatever the
number of clients in the round.  Under secure aggregation (:mod:`mpifl.privacy.secure`) the clients send their
terms already weighted, quantized and masked, as signed integers, and a reduction without coefficients sums them
modulo 2^w (w their bits): integer adds, exact in any order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

SUM_BLOCK = 1 << 14  # elements per block: the float64 partial sum and one term stay in the L1/L2 cache


@dataclass(frozen=True)
class Reduction:
    """sum_k c_k x_k of the uploaded tensor ``upload`` over the round's clients (client-id order); without
    coefficients, sum_k x_k modulo 2^w of uploads of w-bit integers (secure aggregation's masked words)."""

    upload: str
    coefficients: Sequence[float] | None  # (K,): one per client of the round, in client-id order


def mean_weights(weights: np.ndarray) -> np.ndarray:
    """The coefficients of a weighted mean, w_k / sum_j w_j (float64)."""
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


def terms(values: Sequence[np.ndarray], coefficients: Sequence[float] | None) -> list[tuple[float, np.ndarray]]:
    """The terms (c_k, flat x_k) of sum_k c_k x_k, those with c_k = 0 left out (they add nothing); without
    coefficients, (None, flat x_k) of integer uploads, summed modulo 2^w."""
    if coefficients is None:
        if not all(np.issubdtype(v.dtype, np.signedinteger) for v in values):
            raise TypeError("only signed integer tensors are summed modulo 2^w")
        return [(None, np.ravel(x)) for x in values]
    if not all(np.issubdtype(v.dtype, np.floating) for v in values):
        raise TypeError("only floating-point tensors can be summed")
    return [(c, np.ravel(x)) for c, x in zip(np.asarray(coefficients, dtype=np.float64), values) if c]


def fold_ranges(sums, ranges, zero: bool = False, block: int = SUM_BLOCK) -> None:
    """The per-element kernel: add sum_k c_k x_k to each flat float64 ``acc`` of ``sums`` [(acc, [(c_k, flat x_k),
    ...])] over the element ``ranges`` [(index into sums, start, stop)]; with ``zero``, to zero, not to what ``acc``
    held (each block zeroed as it is reached, while in the cache).  Each element's sum is one chain in the terms'
    order, acc <- acc + c_k * float64(x_k): a float64 cast (exact), a multiply and an add, each correctly rounded
    and none fused, so the bits are the same whoever folds which range, and in blocks of any size; ``block``
    elements at a time, every term of a block before the next block, so the partial sum stays in the cache.  A
    term without coefficient is an integer one: acc <- acc + x_k modulo 2^w, in ``acc``'s w-bit integers."""
    scratch = np.empty(min(block, max((stop - start for _, start, stop in ranges), default=0)), dtype=np.float64)
    for index, start, stop in ranges:
        acc, chain = sums[index]
        for low in range(start, stop, block):
            high = min(low + block, stop)
            part, term = acc[low:high], scratch[:high - low]
            if zero:
                part.fill(0.0)
            for c, x in chain:
                if c is None:
                    part += x[low:high]  # numpy's integer adds wrap: modulo 2^w
                    continue
                np.copyto(term, x[low:high])  # then times c: what float64(x) * c gives, faster than one cast multiply
                term *= c
                part += term


def weighted_mean(values: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """sum_k w_k x_k / sum_k w_k in float64, accumulated in client-id order (:func:`weighted_sum`)."""
    if len(weights) != len(values):
        raise ValueError(f"{len(weights)} weights for {len(values)} uploads")
    return weighted_sum(values, mean_weights(weights))


def weighted_sum(values: Sequence[np.ndarray], coefficients: Sequence[float]) -> np.ndarray:
    """sum_k c_k x_k in float64, accumulated in client-id order; terms with c_k = 0 are skipped.

    A fixed order makes the result independent of which rank trained which client (rank-count
    invariance), and of how the clients are split into calls: each element's sum is the same chain of
    additions.  The sum runs block by block over the elements, every client's term of a block before the
    next block, so the partial sum never leaves the cache: each upload is read once and the result
    written once (3x faster than whole-array passes for a 50 MB model, with the same bits): :func:`fold_ranges`.
    """
    acc = np.empty(np.shape(values[0]), dtype=np.float64)
    flat = acc.reshape(-1)
    fold_ranges([(flat, terms(values, coefficients))], [(0, 0, flat.size)], zero=True)
    return acc
