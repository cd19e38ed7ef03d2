"""A client rank's share of the global model's evaluation: its batches (:mod:`mpifl.session.evaluation`) and
their images.

A batch of a client whose images are resident on this rank (a hosted client's) is a slice of them; another
resident client's batches are read from its shard once, when the share is made, and kept on the device (only
this rank's batches' rows); a streamed client's are read from the shard at every evaluation, one batch ahead.
Every batch is normalized as its client's data normalizes an evaluation batch
(:meth:`~mpifl.client.client_data.ClientData.eval_batch`): by the host's normalizer for a hosted client, else by
its domain's (``--input-norm``; another rank scores a client's batches only under ``--aug none``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from ..data import DatasetManifest, open_shard
from ..plan.batches import Segments, rows_between, split_segments, streams
from ..plan.clients import ClientSpec
from ..plan.normalize import Normalizer, fixed, input_stats
from ..session.evaluation import EvalBatch
from ..transport.messages import EVAL_SPLITS
from .client_data import ClientData, ResidentImages, read_rows


@dataclass(frozen=True)
class _Source:
    """Where one batch's images are: rows ``start`` .. ``stop - 1`` of ``data``'s split, or, with ``data`` None,
    the shard rows ``rows`` of ``domain``, normalized by ``normalizer``."""

    data: ClientData | None
    split: str
    start: int = 0
    stop: int = 0
    domain: str = ""
    rows: Segments = ()
    normalizer: Normalizer | None = None


class EvalShare:
    """This rank's ``batches`` of the global model's evaluation, with their images on ``device``; ``hosted``: the
    data of the clients this rank holds (their resident images are used in place)."""

    def __init__(self, root, manifest: DatasetManifest, clients: list[ClientSpec], batches: tuple[EvalBatch, ...],
                 hosted: dict[int, ClientData], device: torch.device, input_norm: str, stream_above_gib: float):
        self.root, self.manifest, self.device = root, manifest, device
        self.batches = batches
        self._sources: list[_Source] = []
        image_bytes = int(np.prod(manifest.image_size)) * manifest.channels
        pieces: dict[tuple[int, str], ClientData] = {}  # another resident client's rows of this share, by split
        filled: dict[tuple[int, str], int] = {}  # rows of each piece handed to batches so far
        with ExitStack() as stack:
            shards, normalizers = {}, {}
            for batch in batches:
                spec, split = clients[batch.client], EVAL_SPLITS[batch.split]
                data = hosted.get(spec.id)
                if data is not None and isinstance(data.images[split], ResidentImages):
                    self._sources.append(_Source(data, split, batch.start, batch.stop))
                    continue
                if spec.domain not in shards:
                    shards[spec.domain] = stack.enter_context(open_shard(root, manifest, spec.domain))
                    normalizers[spec.domain] = fixed(*input_stats(input_norm, manifest, shards[spec.domain]),
                                                     device=device)
                segments = split_segments(spec)[split]
                if data is not None or streams(spec, image_bytes, stream_above_gib):
                    self._sources.append(_Source(None, split, domain=spec.domain,
                                                 rows=rows_between(segments, batch.start, batch.stop),
                                                 normalizer=normalizers[spec.domain] if data is None else
                                                 data.normalizer))
                    continue
                key = (spec.id, split)
                if key not in pieces:
                    parts = [part for b in batches if (b.client, EVAL_SPLITS[b.split]) == key
                             for part in rows_between(segments, b.start, b.stop)]
                    pixels, labels = read_rows(shards[spec.domain], parts, device)
                    pieces[key] = _piece(split, pixels, labels, normalizers[spec.domain])
                    filled[key] = 0
                start, filled[key] = filled[key], filled[key] + batch.stop - batch.start
                self._sources.append(_Source(pieces[key], split, start, filled[key]))

    def __iter__(self) -> Iterator[tuple[EvalBatch, torch.Tensor, torch.Tensor]]:
        """(batch, model input, labels) of each batch, in order; batches read from a shard are read one ahead."""
        reads = [i for i, source in enumerate(self._sources) if source.data is None]
        with ExitStack() as stack, ThreadPoolExecutor(1) as reader:
            shards = {}

            def read(i: int) -> tuple[torch.Tensor, torch.Tensor]:  # in the reader thread
                source = self._sources[i]
                if source.domain not in shards:
                    shards[source.domain] = stack.enter_context(open_shard(self.root, self.manifest, source.domain))
                return read_rows(shards[source.domain], source.rows, self.device)

            upcoming = iter(reads)
            first = next(upcoming, None)
            pending = None if first is None else reader.submit(read, first)
            for batch, source in zip(self.batches, self._sources):
                if source.data is not None:
                    yield (batch, *source.data.eval_batch(source.split, source.start, source.stop))
                    continue
                pixels, labels = pending.result()
                following = next(upcoming, None)
                pending = None if following is None else reader.submit(read, following)
                yield (batch, *_piece(source.split, pixels, labels, source.normalizer).eval_batch(
                    source.split, 0, len(labels)))


def _piece(split: str, pixels: torch.Tensor, labels: torch.Tensor, normalizer: Normalizer) -> ClientData:
    """Rows of a client's split (and no training images) as client data."""
    return ClientData({split: ResidentImages(pixels)}, {split: labels}, normalizer, own=(split, 0))
