"""Shared machinery for converters whose sources are arrays, not image folders.

Digits-Five (:mod:`mpifl.data.digits`) and CIFAR-10 / CIFAR-10-C
(:mod:`mpifl.data.cifar`) ship as IDX files, MATLAB ``.mat`` files, HDF5,
pickles or ``.npy`` arrays.  Their converters check the source layout, then
hand :func:`convert_arrays` one :class:`ArrayDomain` per domain whose
``load()`` returns the domain's splits as in-memory arrays at the final size.
:func:`convert_arrays` writes the shards and ``manifest.json`` with the same
atomic pattern as :func:`mpifl.data.folders.convert_folders` (a temporary
folder under ``--data-root``, renamed onto ``<out>/<name>`` only when everything
succeeded, deleted on any error), reusing its helpers.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from mpifl.errors import MpiflError
from mpifl.data.manifest import DatasetManifest, build_manifest
from mpifl.data.shard import SPLITS, ShardWriter
from mpifl.data.splits import SPLIT_SEED, stratified_split
from mpifl.data.staging import staged_dataset

def _latin1(text, encoding="utf-8", errors="strict"):
    """``_codecs.encode`` as protocol 0-2 pickles use it for ``bytes``: ``str`` to latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not a "
                                     "latin-1 bytes literal")
    return text.encode("latin-1", errors)


def _array_globals() -> dict:
    """The globals an ndarray pickle may name (numpy 1.x and 2.x module names) -> this numpy's objects."""
    try:  # numpy >= 2 (1.26 has the alias too)
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy < 1.26
        from numpy.core import multiarray, numeric
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype, ("_codecs", "encode"): _latin1}
    for core in ("numpy.core", "numpy._core"):
        allowed[f"{core}.multiarray", "_reconstruct"] = multiarray._reconstruct  # protocols 0-4
        allowed[f"{core}.multiarray", "scalar"] = multiarray.scalar  # numpy scalars (np.int64(3))
        allowed[f"{core}.numeric", "_frombuffer"] = numeric._frombuffer  # protocol 5
    return allowed


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays, their dtypes and scalars, and plain containers; refuses any other global."""

    def __init__(self, file, path: Path, holds: str, fix: str, encoding: str):
        super().__init__(file, encoding=encoding)
        self.path, self.holds, self.fix, self.allowed = path, holds, fix, _array_globals()

    def find_class(self, module, name):
        found = self.allowed.get((module, name))
        if found is None:
            raise MpiflError(f"{self.path} refers to {module}.{name}, which a pickle of {self.holds} never holds "
                             f"(a pickle can run code as it loads, so mpifl refused it); {self.fix}")
        return found


def load_array_pickle(file, path: Path, holds: str, fix: str, encoding: str = "ASCII"):
    """The object pickled in the open binary ``file`` (named ``path``), admitting only numpy arrays, their dtypes
    and scalars, and plain containers: a pickle can name any Python callable and run it while it loads, so
    every other global is refused in one line (:class:`~mpifl.errors.MpiflError`: ``holds`` says what the
    file should hold, ``fix`` what to do) before it is imported or called.  ``encoding``: pickle's, for
    Python 2 strings ("bytes" keeps them bytes)."""
    return _ArrayUnpickler(file, path, holds, fix, encoding).load()


_BILINEAR = getattr(Image, "Resampling", Image).BILINEAR
#: Images handed to the shard writer at a time.
WRITE_BATCH = 4096
RESIZE_NOTE = ("resized once to SxS with Pillow bilinear (antialiased), as torchvision's Resize; "
               "grayscale replicated to 3 channels")


@dataclass(frozen=True)
class ArrayDomain:
    """One domain to write: its id, the shard's ``source`` text and a loader.

    ``load()`` returns ``{split: (images uint8 N x S x S x 3, labels int64 N)}``
    for every split in :data:`~mpifl.data.shard.SPLITS`.
    """

    id: str
    source: str
    load: Callable[[], dict]


def to_rgb(images, size: int, what: str) -> np.ndarray:
    """``images`` (N x H x W, N x H x W x 1 or N x H x W x 3, uint8) as uint8 N x size x size x 3.

    Images not already ``size x size`` are resized one by one with Pillow's
    bilinear (antialiased) filter; grayscale is resized, then replicated to
    three channels.  ``what`` names the source in error messages.
    """
    images = np.asarray(images)
    if images.dtype != np.uint8:
        raise MpiflError(f"{what} holds {images.dtype} pixels, expected uint8; use the original files")
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    if not (images.ndim == 3 or images.ndim == 4 and images.shape[-1] == 3):
        raise MpiflError(f"{what} holds images of shape {images.shape[1:]}, expected HxW or HxWx3; "
                         "use the original files")
    n = len(images)
    if images.shape[1:3] != (size, size):
        resized = np.empty((n, size, size, *images.shape[3:]), np.uint8)
        for i in range(n):
            resized[i] = np.asarray(Image.fromarray(images[i]).resize((size, size), _BILINEAR))
        images = resized
    if images.ndim == 3:
        images = np.repeat(images[..., None], 3, axis=-1)
    return np.ascontiguousarray(images)


def check_labels(labels, count: int, num_classes: int, what: str) -> np.ndarray:
    """``labels`` as int64, checked to be ``count`` values in ``0..num_classes-1``."""
    labels = np.asarray(labels).reshape(-1)
    if labels.size and labels.dtype.kind == "f":
        if not np.all(np.isfinite(labels)) or not np.all(labels == np.round(labels)):
            raise MpiflError(f"{what} holds non-integer labels; use the original files")
    elif labels.size and labels.dtype.kind not in "iu":
        raise MpiflError(f"{what} holds {labels.dtype} labels, expected integers; use the original files")
    if len(labels) != count:
        raise MpiflError(f"{what} has {len(labels)} labels for {count} images; the files do not belong "
                         "together: use matching image and label files")
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise MpiflError(f"{what} has labels {labels.min()}..{labels.max()}, expected 0..{num_classes - 1}; "
                         "use the original files")
    return labels


def seeded_split(labels: np.ndarray, fractions, key: tuple) -> list[np.ndarray]:
    """Row indices of a seeded stratified split of ``labels`` by ``fractions``.

    Per class, the class's row indices (ascending) are permuted by a generator
    seeded from ``(SPLIT_SEED, *key, class)`` and cut at the cumulative
    fractions (see :func:`mpifl.data.folders.stratified_split`).  Each part is
    sorted by class, then row index.
    """
    labels = np.asarray(labels)
    groups = {int(c): np.flatnonzero(labels == c) for c in np.unique(labels)}
    return [np.asarray(part, dtype=np.int64) for part in stratified_split(groups, fractions, key)]


def carve_val(train: np.ndarray, labels: np.ndarray, fraction: float, key: tuple
              ) -> tuple[np.ndarray, np.ndarray]:
    """Split the row indices ``train`` into (train, val): a seeded stratified ``fraction`` per class."""
    kept, val = seeded_split(labels[train], (1 - fraction, fraction), (*key, "val"))
    return train[kept], train[val]


def split_rule(fractions, val_fraction: float | None = None) -> str:
    cut = "/".join(f"{100 * f:g}" for f in fractions)
    names = "train/test" if len(fractions) == 2 else "train/val/test"
    rule = f"seeded stratified split per domain and class: {names} = {cut} % (seed {SPLIT_SEED})"
    if val_fraction is not None:
        rule += f"; val = seeded stratified {100 * val_fraction:g} % of train"
    return rule


def convert_arrays(name: str, src: Path, out: Path, domains: list[ArrayDomain], classes, size: int,
                   source: str, protocol: dict, log: Callable[[str], None]) -> DatasetManifest:
    """Write ``domains`` as shards + manifest into ``<out>/<name>`` atomically; return the manifest."""
    src, out = Path(src), Path(out)
    started = time.monotonic()
    total = 0
    with staged_dataset(out, name, src) as built:
        for domain in domains:
            t0 = time.monotonic()
            splits = domain.load()
            with ShardWriter(built / f"{domain.id}.h5", dataset=name, domain=domain.id, classes=classes,
                             image_size=(size, size), channels=3, source=domain.source) as writer:
                for split in SPLITS:
                    images, labels = splits[split]
                    for start in range(0, len(images), WRITE_BATCH):
                        writer.add(split, images[start:start + WRITE_BATCH],
                                   labels[start:start + WRITE_BATCH])
            sizes = "/".join(str(len(splits[s][1])) for s in SPLITS)
            total += sum(len(splits[s][1]) for s in SPLITS)
            log(f"{name}: {domain.id} train/val/test {sizes} in {time.monotonic() - t0:.1f} s")
            del splits
        build_manifest(built.parent, name, source=f"{source}; converted from {src.resolve()}", protocol=protocol)
    log(f"{name}: converted {total} images at {size}x{size} in {time.monotonic() - started:.1f} s")
    return DatasetManifest.load(out, name)


def check_size(size: int | None, default: int) -> int:
    size = default if size is None else int(size)
    if size < 1:
        raise MpiflError(f"image size {size} must be at least 1 pixel; pass --size S with S >= 1")
    return size


def visible_dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
