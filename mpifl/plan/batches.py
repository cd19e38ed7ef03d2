"""Where a client's splits lie in its domain's shard, and the batches an evaluation of a split forms.

A client's split is one or more *segments* of its shard, (shard split, ascending rows): a training client's
split s is its rows of the shard's split s; a held-out domain's test split is all its rows, train, val and test
in turn (its train and val splits are empty).  A client's images are resident on its device or, above
``--stream-above`` GiB for all its splits together, streamed from the shard in blocks of :data:`STREAM_BLOCK` rows
of one segment.  An evaluation takes a split in order, ``--eval-batch-size`` rows at a time, a streamed one block
by block (a batch never spans two blocks): :func:`eval_bounds` gives those batches from the configuration alone,
so every rank knows them (:mod:`mpifl.session.evaluation` spreads them over the ranks) and the client's data
forms the same ones (:mod:`mpifl.client.client_data`).
"""

from __future__ import annotations

import numpy as np

from .clients import SPLITS, ClientSpec

Segments = list[tuple[str, np.ndarray]]  # (shard split, ascending rows) making up one of a client's splits
STREAM_BLOCK = 2048  # rows a streamed split reads at once


def split_segments(client: ClientSpec) -> dict[str, Segments]:
    """Which shard rows make up each of the client's splits (a held-out domain: all rows are test)."""
    if client.trains:
        return {split: [(split, client.rows[split])] for split in SPLITS}
    empty = np.zeros(0, dtype=np.int64)
    return {"train": [("train", empty)], "val": [("val", empty)],
            "test": [(split, client.rows[split]) for split in SPLITS]}


def streams(client: ClientSpec, image_bytes: int, stream_above_gib: float) -> bool:
    """Whether the client's images, all its splits together, exceed ``--stream-above`` and are streamed."""
    rows = sum(len(r) for parts in split_segments(client).values() for _, r in parts)
    return rows * image_bytes > stream_above_gib * 2**30


def stream_blocks(segments: Segments, block: int = STREAM_BLOCK) -> list[tuple[str, np.ndarray, int]]:
    """A streamed split's blocks: (shard split, rows, position of the first in the client's split)."""
    blocks, position = [], 0
    for split, rows in segments:
        for start in range(0, len(rows), block):
            blocks.append((split, rows[start:start + block], position))
            position += len(rows[start:start + block])
    return blocks


def eval_bounds(segments: Segments, batch_size: int, streamed: bool,
                block: int = STREAM_BLOCK) -> list[tuple[int, int]]:
    """(start, stop) positions in the split of each batch an evaluation forms, in order."""
    if not streamed:
        total = sum(len(rows) for _, rows in segments)
        return [(start, min(start + batch_size, total)) for start in range(0, total, batch_size)]
    return [(first + start, first + min(start + batch_size, len(rows)))
            for _, rows, first in stream_blocks(segments, block) for start in range(0, len(rows), batch_size)]


def rows_between(segments: Segments, start: int, stop: int) -> Segments:
    """The shard rows at positions ``start`` .. ``stop - 1`` of a split, as segments."""
    out, first = [], 0
    for split, rows in segments:
        lo, hi = max(start - first, 0), min(stop - first, len(rows))
        if lo < hi:
            out.append((split, rows[lo:hi]))
        first += len(rows)
    return out
