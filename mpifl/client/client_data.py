"""A client's images on its host rank, batched without per-sample Python work.

A host rank opens only the shards of the domains its clients hold.  A
client's images either stay **resident** (read once, kept on the device as
uint8 NCHW; a mini-batch is one index-select) or, when they exceed
``--stream-above`` GiB, **stream** from the shard in blocks of rows read by a
background thread one block ahead.  The choice is made per client from its
own size, so it never depends on the number of ranks.

Either way a mini-batch becomes the model's input by one fused
scale-and-shift, ``x = (p / 255 - mean) / std = p * (1 / (255 std)) - mean /
std``, with the (mean, std) its :class:`~mpifl.plan.normalize.Normalizer` gives: the
dataset's as ``--input-norm`` says (:func:`~mpifl.plan.normalize.input_stats`), drawn per
batch or per image under FedRDN (``--aug``);
training batches first pass ``--train-transforms`` (:mod:`mpifl.client.transforms`), which move a
segmentation task's masks with their images.

Epoch order: resident data follow one seeded permutation of all rows;
streamed data visit their blocks in a seeded order and permute the rows
inside each block (rows left over at a block's end open the next block's
batches), the usual trade of shuffling for sequential reads.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..data import DatasetManifest, open_shard
from ..plan.batches import STREAM_BLOCK, Segments, split_segments, stream_blocks, streams
from ..plan.clients import ClientSpec
from ..plan.normalize import Normalizer, fixed, input_stats
from .transforms import TrainTransforms


class ResidentImages:
    """All of a split's images on the device."""

    def __init__(self, pixels: torch.Tensor):
        self.pixels = pixels

    def __len__(self) -> int:
        return len(self.pixels)

    def shuffled(self, rng: np.random.Generator, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.from_numpy(rng.permutation(len(self))).to(self.pixels.device)
        for start in range(0, len(self), batch_size):
            index = order[start:start + batch_size]
            yield self.pixels[index], index

    def in_order(self, batch_size: int) -> Iterator[tuple[torch.Tensor, slice]]:
        for start in range(0, len(self), batch_size):
            yield self.pixels[start:start + batch_size], slice(start, start + batch_size)


class StreamedImages:
    """A split's images read from its shard in blocks of ``block`` rows, one block ahead."""

    def __init__(self, root, manifest: DatasetManifest, domain: str, segments: Segments, device, block: int):
        self.root, self.manifest, self.domain, self.device = root, manifest, domain, device
        self.blocks = stream_blocks(segments, block)  # (shard split, rows, first position within this split)
        self.length = sum(len(rows) for _, rows in segments)

    def __len__(self) -> int:
        return self.length

    def _read(self, shard, block_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        split, rows, first = self.blocks[block_index]
        pixels, _ = shard.load(split, indices=rows)
        pixels = torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))).to(self.device)
        return pixels, torch.arange(first, first + len(rows), device=self.device)

    def _blocks(self, order) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = list(order)
        with open_shard(self.root, self.manifest, self.domain) as shard, ThreadPoolExecutor(1) as reader:
            pending = reader.submit(self._read, shard, order[0]) if order else None
            for i in range(len(order)):
                block = pending.result()
                pending = reader.submit(self._read, shard, order[i + 1]) if i + 1 < len(order) else None
                yield block

    def shuffled(self, rng: np.random.Generator, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        carry_pixels, carry_index = None, None
        for pixels, index in self._blocks(rng.permutation(len(self.blocks))):
            perm = torch.from_numpy(rng.permutation(len(index))).to(self.device)
            pixels, index = pixels[perm], index[perm]
            if carry_pixels is not None:
                pixels, index = torch.cat([carry_pixels, pixels]), torch.cat([carry_index, index])
            full = len(index) - len(index) % batch_size
            for start in range(0, full, batch_size):
                yield pixels[start:start + batch_size], index[start:start + batch_size]
            carry_pixels, carry_index = pixels[full:], index[full:]
        if carry_index is not None and len(carry_index):
            yield carry_pixels, carry_index

    def in_order(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for pixels, index in self._blocks(range(len(self.blocks))):
            for start in range(0, len(index), batch_size):
                yield pixels[start:start + batch_size], index[start:start + batch_size]


class ClientData:
    """Train/val/test images (resident or streamed) and labels (always resident: class ids, or uint8 masks of a
    segmentation task) of one client; batches carry the labels as int64."""

    def __init__(self, images: dict, labels: dict[str, torch.Tensor], normalizer: Normalizer,
                 transforms: TrainTransforms | None = None, own: tuple[str, int] | None = None):
        self.images = images
        self.labels = labels
        self.normalizer = normalizer
        self.transforms = transforms or TrainTransforms(())
        # where the client's training images lie: (split, how many leading rows); a held-out domain's are the
        # shard's train rows at the head of its test split
        self.own = own or ("train", self.size("train"))

    def with_train(self, pixels: torch.Tensor, labels: torch.Tensor) -> "ClientData":
        """This client's data training on ``pixels`` (uint8 NCHW, kept on their device) and ``labels`` instead
        of its training split (a method's rebuilt training set, ``Algorithm.training_data``); its own images
        (:meth:`own_chunks`), validation and test splits stay as they are."""
        split, count = self.own
        images = {**self.images, "own": self.images[split], "train": ResidentImages(pixels)}
        return ClientData(images, {**self.labels, "train": labels}, self.normalizer, self.transforms, ("own", count))

    @property
    def streamed(self) -> bool:
        """Whether the training images are read from the shard as needed (``--stream-above``)."""
        return isinstance(self.images["train"], StreamedImages)

    def size(self, split: str) -> int:
        return len(self.labels[split])

    def _input(self, pixels: torch.Tensor, affine, rng: np.random.Generator | None = None,
               labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's input and the labels; with ``rng``, both through ``--train-transforms`` (labels with
        more than one dimension are masks and move with the image, :mod:`~mpifl.client.transforms`)."""
        scale, shift = affine
        x = pixels.float()
        if rng is not None and self.transforms:
            masks = labels if labels is not None and labels.dim() > 1 else None
            x, masks = self.transforms.with_masks(x, masks, rng)
            labels = labels if masks is None else masks
        return torch.addcmul(shift, x, scale), labels

    def train_batches(self, rng: np.random.Generator, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch in a seeded random order.

        A last batch of a single sample is dropped when batch_size > 1: batch
        normalization cannot train on one sample, and the sample is seen in
        other epochs and rounds under other orders.
        """
        for pixels, index in self.images["train"].shuffled(rng, batch_size):
            if len(pixels) == 1 and batch_size > 1:
                return
            x, labels = self._input(pixels, self.normalizer.train(len(pixels), rng), rng, self.labels["train"][index])
            yield x, labels.long()

    def sampled_batch(self, rng: np.random.Generator, rate: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A batch holding each training record independently with probability ``rate`` (Poisson sampling, as
        DP-SGD's accounting assumes), in row order; None when it drew no record.  Resident images only."""
        rows = np.flatnonzero(rng.random(self.size("train")) < rate)
        if not len(rows):
            return None
        index = torch.from_numpy(rows).to(self.labels["train"].device)
        pixels = self.images["train"].pixels[index]
        x, labels = self._input(pixels, self.normalizer.train(len(pixels), rng), rng, self.labels["train"][index])
        return x, labels.long()

    def eval_batches(self, split: str, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        affine = self.normalizer.eval()
        for pixels, index in self.images[split].in_order(batch_size):
            yield self._input(pixels, affine)[0], self.labels[split][index].long()

    def eval_batch(self, split: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start`` .. ``stop - 1`` of a resident split, as :meth:`eval_batches` gives a batch of them."""
        pixels = self.images[split].pixels[start:stop]
        return self._input(pixels, self.normalizer.eval())[0], self.labels[split][start:stop].long()

    def pixel_chunks(self, split: str) -> Iterator[torch.Tensor]:
        """The split's uint8 images in chunks, for statistics over a whole split."""
        for pixels, _ in self.images[split].in_order(256):
            yield pixels

    def own_chunks(self, rng: np.random.Generator | None = None) -> Iterator[torch.Tensor]:
        """The client's training images in chunks (a held-out domain's: its shard's train split), for its own
        statistics; with ``rng``, passed once through ``--train-transforms`` as a training epoch would."""
        split, left = self.own
        for pixels in self.pixel_chunks(split):
            if left <= 0:
                return
            pixels, left = pixels[:left], left - len(pixels)
            yield self.transforms(pixels.float(), rng) if rng is not None and self.transforms else pixels


def load_client_data(root: str | Path, manifest: DatasetManifest, clients: list[ClientSpec],
                     device: torch.device, stream_above_gib: float = float("inf"),
                     block: int = STREAM_BLOCK, transforms: TrainTransforms | None = None,
                     input_norm: str = "pooled") -> dict[int, ClientData]:
    """Each hosted client's labels, and its images resident or streamed (normalized as ``--input-norm``
    says, :func:`~mpifl.plan.normalize.input_stats`)."""
    image_bytes = int(np.prod(manifest.image_size)) * manifest.channels
    out: dict[int, ClientData] = {}
    for domain in sorted({c.domain for c in clients}, key=manifest.domains.index):
        with open_shard(root, manifest, domain) as shard:
            normalizer = fixed(*input_stats(input_norm, manifest, shard), device=device)
            for client in (c for c in clients if c.domain == domain):
                segments = split_segments(client)
                labels = {s: torch.from_numpy(np.concatenate([shard.labels(k)[r] for k, r in parts])).to(device)
                          for s, parts in segments.items()}
                streamed = streams(client, image_bytes, stream_above_gib)
                images = {s: StreamedImages(root, manifest, domain, parts, device, block) if streamed else
                          ResidentImages(_read_all(shard, parts, device)) for s, parts in segments.items()}
                own = ("train" if client.trains else "test", len(client.rows["train"]))
                out[client.id] = ClientData(images, labels, normalizer, transforms, own)
    return out


def read_rows(shard, parts: Segments, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The images (uint8 NCHW) and labels of the shard rows ``parts`` names (at least one), on ``device``."""
    loaded = [shard.load(split, indices=rows) for split, rows in parts]
    pixels = np.concatenate([x for x, _ in loaded])
    return (torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))).to(device),
            torch.from_numpy(np.concatenate([y for _, y in loaded])).to(device))


def _read_all(shard, parts: Segments, device) -> torch.Tensor:
    height, width = shard.image_size
    pixels = np.concatenate([np.zeros((0, height, width, shard.channels), np.uint8)]
                            + [shard.load(split, indices=rows)[0] for split, rows in parts if len(rows)])
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))).to(device)
