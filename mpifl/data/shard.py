"""One HDF5 shard per domain: the on-disk format of every mpifl dataset.

A shard ``datasets/<name>/<domain>.h5`` (format version :data:`FORMAT_VERSION`)
holds three groups, ``train``, ``val`` and ``test``, each with

* ``images``: uint8, N x H x W x C, chunked along N (about 1 MiB a chunk),
  uncompressed so that reading is as fast as the disk;
* ``labels``: int64, N, class indices into the ``classes`` attribute; for a
  segmentation shard (attribute ``task``), uint8 masks, N x H x W, each pixel's
  class index (chunked like the images).

File attributes: ``format_version``, ``dataset``, ``domain``, ``task``
(``classification`` or ``segmentation``; a shard without it is a
classification one), ``classes`` (a JSON list of class names; of a
segmentation shard, the mask values' names, background first), ``source`` (where the data came from),
``image_size`` ([H, W]), ``channels``, ``mean`` and ``std`` (per-channel
statistics of the train images over all pixels, in [0, 1] units; NaN when the
train split is empty), ``created_by`` and ``content_sha256`` (:func:`content_digest` of what the shard holds,
computed while it is written; a shard written before it existed has none).

:class:`ShardWriter` streams a shard into a temporary file and moves it into
place only when complete, so a reader never sees a half-written shard.
:class:`Shard` opens one read-only and checks it before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import h5py
import numpy as np

from mpifl import __version__
from mpifl.data.names import CLASS_NAME, PLAIN_NAME, is_class_name, is_plain_name
from mpifl.errors import MpiflError

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")
CHUNK_BYTES = 1 << 20
LABEL_CHUNK = 4096
_STATS_BLOCK = 1 << 18  # pixels per float64 block when accumulating train statistics

TASKS = ("classification", "segmentation")
_ATTRS = ("format_version", "dataset", "domain", "classes", "source",
          "image_size", "channels", "mean", "std", "created_by")
CONTENT = "content_sha256"  # the attribute that holds content_digest(...)


def content_digest(identity: dict, splits: dict[str, tuple[int, str, str]]) -> str:
    """The sha256 that tells one shard's content from another's, whatever file holds it: of ``identity`` (dataset,
    domain, task, classes, image size, channels) as sorted JSON, then per split, in :data:`SPLITS` order, its
    image count and the sha256 of its images (uint8, row-major) and of its labels (int64 little-endian; masks
    uint8), as ``splits`` gives them: ``{split: (n, images_sha256, labels_sha256)}``.  The source and the
    writing mpifl's version are left out: two builds of the same images from the same folder agree."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    for split in SPLITS:
        n, images, labels = splits[split]
        digest.update(f"\n{split} {n} {images} {labels}".encode())
    return digest.hexdigest()


def default_fix(path: Path) -> str:
    """The remedy for a bad shard when the caller knows no better one."""
    return f"run `python -m mpifl.data prepare {path.parent.name} --src DIR` to rebuild it"


class ShardWriter:
    """Write one domain's shard, split by split, in as many chunks as needed.

    Use as a context manager::

        with ShardWriter(path, dataset="pacs", domain="sketch", classes=names,
                         image_size=(224, 224), channels=3, source="...") as w:
            for images, labels in batches:
                w.add("train", images, labels)

    Data goes to ``<path>.tmp-<pid>``; a clean exit writes the attributes and
    renames the file onto ``path`` atomically, an exception deletes it.  The
    train mean/std are accumulated while adding, never re-read.  A split's
    chunk holds about :data:`CHUNK_BYTES` of images, or the first batch added
    to that split if it is smaller (so a 100-image split does not occupy a
    mostly empty 1 MiB chunk): stream batches of at least CHUNK_BYTES of
    images.  Labels are chunked by up to :data:`LABEL_CHUNK` rows.
    """

    def __init__(self, path, *, dataset: str, domain: str, classes, image_size,
                 channels: int, source: str, task: str = "classification"):
        self.path = Path(path)
        if task not in TASKS:
            raise MpiflError(f"shard {self.path}: unknown task {task!r}; use one of {', '.join(TASKS)}")
        self.task = task
        self.classes = [str(c) for c in classes]
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise MpiflError(f"shard {self.path}: class names must be non-empty and unique, "
                             f"got {self.classes!r}; fix the converter's class list")
        bad = [c for c in self.classes if not is_class_name(c)]
        if bad:
            raise MpiflError(f"shard {self.path}: class {bad[0]!r} is not a plain name ({CLASS_NAME}); rename its "
                             "folder or fix the converter's class list")
        if not is_plain_name(domain):
            raise MpiflError(f"shard {self.path}: domain {domain!r} is not a plain name ({PLAIN_NAME}); rename the "
                             "domain's folder or file")
        h, w = (int(v) for v in image_size)
        if h <= 0 or w <= 0 or int(channels) <= 0:
            raise MpiflError(f"shard {self.path}: bad image size {h}x{w}x{channels}; "
                             "give positive height, width and channels")
        self.shape = (h, w, int(channels))
        self._attrs = {"format_version": FORMAT_VERSION, "dataset": str(dataset),
                       "domain": str(domain), "classes": json.dumps(self.classes),
                       "source": str(source), "image_size": np.array([h, w], np.int64),
                       "channels": int(channels), "created_by": f"mpifl {__version__}", "task": task}
        self._identity = {"dataset": str(dataset), "domain": str(domain), "task": task, "classes": self.classes,
                          "image_size": [h, w], "channels": int(channels)}
        self._hashes = {split: (hashlib.sha256(), hashlib.sha256()) for split in SPLITS}  # images, labels
        self._sum = np.zeros(self.shape[2], np.float64)
        self._sumsq = np.zeros(self.shape[2], np.float64)
        self._pixels = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        self._file = h5py.File(self._tmp, "w")

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, split: str, images: np.ndarray, labels: np.ndarray) -> None:
        """Append ``images`` (uint8, n x H x W x C) and ``labels`` (n ints; of a segmentation shard, uint8
        masks n x H x W) to ``split``."""
        if split not in SPLITS:
            raise MpiflError(f"shard {self.path}: unknown split {split!r}; use one of {', '.join(SPLITS)}")
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.dtype != np.uint8:
            raise MpiflError(f"shard {self.path}: {split} images are {images.dtype}, expected uint8; "
                             "convert pixels to 0..255 uint8 before adding")
        if images.ndim != 4 or images.shape[1:] != self.shape:
            raise MpiflError(f"shard {self.path}: {split} images have shape {images.shape}, expected "
                             f"(n, {', '.join(map(str, self.shape))}); resize to the shard's image size")
        if self.task == "segmentation":
            if labels.dtype != np.uint8 or labels.shape != (len(images), *self.shape[:2]):
                raise MpiflError(f"shard {self.path}: {split} masks must be uint8 of shape "
                                 f"({len(images)}, {self.shape[0]}, {self.shape[1]}), got {labels.dtype} "
                                 f"{labels.shape}; pass one mask of class indices per image")
        elif labels.shape != (len(images),) or (labels.size and labels.dtype.kind not in "iu"):
            raise MpiflError(f"shard {self.path}: {split} labels must be {len(images)} integers, got "
                             f"{labels.dtype} of shape {labels.shape}; pass one class index per image")
        if labels.size and (labels.min() < 0 or labels.max() >= len(self.classes)):
            raise MpiflError(f"shard {self.path}: {split} labels span {labels.min()}..{labels.max()}, "
                             f"expected 0..{len(self.classes) - 1}; map labels to class indices")
        img_ds, lab_ds = self._datasets(split, len(images))
        n0 = img_ds.shape[0]
        img_ds.resize(n0 + len(images), axis=0)
        lab_ds.resize(n0 + len(images), axis=0)
        labels = labels if self.task == "segmentation" else labels.astype("<i8")
        img_ds[n0:] = images
        lab_ds[n0:] = labels
        self._hashes[split][0].update(np.ascontiguousarray(images))
        self._hashes[split][1].update(np.ascontiguousarray(labels))
        if split == "train":
            self._accumulate(images)

    def _accumulate(self, images: np.ndarray) -> None:
        """Add the images' per-channel pixel sums and sums of squares.

        Pixels are integers, so float64 sums stay exact (below 2**53); the
        work goes in blocks to bound the float64 copy for large batches.
        """
        flat = images.reshape(-1, self.shape[2])
        for start in range(0, len(flat), _STATS_BLOCK):
            block = flat[start:start + _STATS_BLOCK].astype(np.float64)
            self._sum += block.sum(axis=0)
            self._sumsq += np.einsum("ij,ij->j", block, block)
        self._pixels += len(flat)

    def _datasets(self, split: str, first_batch: int):
        """The split's (images, labels) datasets, created on first use."""
        if split in self._file:
            return self._file[split]["images"], self._file[split]["labels"]
        rows = max(1, CHUNK_BYTES // int(np.prod(self.shape)))
        if first_batch:
            rows = min(rows, first_batch)
        group = self._file.create_group(split)
        images = group.create_dataset("images", shape=(0, *self.shape), maxshape=(None, *self.shape),
                                      dtype=np.uint8, chunks=(rows, *self.shape))
        if self.task == "segmentation":
            mask = self.shape[:2]
            labels = group.create_dataset("labels", shape=(0, *mask), maxshape=(None, *mask), dtype=np.uint8,
                                          chunks=(rows, *mask))
        else:
            label_rows = max(rows, min(LABEL_CHUNK, first_batch or LABEL_CHUNK))
            labels = group.create_dataset("labels", shape=(0,), maxshape=(None,), dtype=np.int64,
                                          chunks=(label_rows,))
        return images, labels

    def close(self) -> Path:
        """Finish the shard: write statistics and attributes, move it into place."""
        if not self._file.id.valid:  # already closed
            return self.path
        try:
            for split in SPLITS:
                self._datasets(split, 0)
            with np.errstate(invalid="ignore", divide="ignore"):
                mean = self._sum / self._pixels / 255.0
                var = self._sumsq / self._pixels / 255.0 ** 2 - mean ** 2
            self._file.attrs.update(self._attrs)
            self._file.attrs[CONTENT] = content_digest(self._identity, {
                split: (self._file[split]["images"].shape[0], *(h.hexdigest() for h in self._hashes[split]))
                for split in SPLITS})
            self._file.attrs["mean"] = mean
            self._file.attrs["std"] = np.sqrt(np.maximum(var, 0.0))
            self._file.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Drop the partial shard: close and delete the temporary file."""
        if self._file.id.valid:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


class Shard:
    """A validated, read-only shard.  Use as a context manager or call :meth:`close`.

    ``fix`` is the remedy quoted in error messages (how to rebuild the shard);
    callers that know the dataset pass theirs, the default says to re-run
    ``prepare``.
    """

    def __init__(self, path, fix: str | None = None):
        self.path = Path(path)
        self.fix = fix or default_fix(self.path)
        if not self.path.is_file():
            raise MpiflError(f"shard missing: {self.path}; {self.fix}")
        if not h5py.is_hdf5(self.path):
            raise MpiflError(f"shard {self.path} is not an HDF5 file; {self.fix}")
        # Shards are replaced atomically, never written in place, so readers need
        # no HDF5 file lock (which fails on some cluster file systems).
        try:
            self._file = h5py.File(self.path, "r", locking=False)
        except OSError as e:
            raise self._fail(f"cannot be read ({e})") from None
        try:
            self._check()
        except (OSError, TypeError, ValueError) as e:
            self._file.close()
            raise self._fail(f"cannot be read or is malformed ({e})") from None
        except BaseException:
            self._file.close()
            raise

    def _fail(self, problem: str) -> MpiflError:
        return MpiflError(f"shard {self.path}: {problem}; {self.fix}")

    def _check(self) -> None:
        attrs = self._file.attrs
        version = attrs.get("format_version")
        if version != FORMAT_VERSION:
            raise self._fail(f"format version {version}, this mpifl reads version {FORMAT_VERSION}")
        missing = [a for a in _ATTRS if a not in attrs]
        if missing:
            raise self._fail(f"missing attributes {', '.join(missing)}")
        try:
            classes = json.loads(attrs["classes"])
        except (TypeError, ValueError):
            classes = None
        if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
            raise self._fail("attribute classes is not a JSON list of names")
        self.classes = classes
        self.task = str(attrs.get("task", "classification"))
        if self.task not in TASKS:
            raise self._fail(f"unknown task {self.task!r} (this mpifl knows {', '.join(TASKS)})")
        self.image_size = tuple(int(v) for v in attrs["image_size"])
        self.channels = int(attrs["channels"])
        self.mean = np.asarray(attrs["mean"], np.float64)
        self.std = np.asarray(attrs["std"], np.float64)
        if len(self.image_size) != 2 or not self.mean.shape == self.std.shape == (self.channels,):
            raise self._fail("attributes image_size/mean/std do not match channels")
        shape = (*self.image_size, self.channels)
        self.sizes = {}
        for split in SPLITS:
            group = self._file.get(split)
            if not isinstance(group, h5py.Group) or "images" not in group or "labels" not in group:
                raise self._fail(f"group {split} with images and labels is missing")
            images, labels = group["images"], group["labels"]
            if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != shape:
                raise self._fail(f"{split}/images is {images.dtype} {images.shape}, "
                                 f"expected uint8 (N, {', '.join(map(str, shape))})")
            if self.task == "segmentation":
                if labels.dtype != np.uint8 or labels.shape != (len(images), *self.image_size):
                    raise self._fail(f"{split}/labels is {labels.dtype} {labels.shape}, expected uint8 masks "
                                     f"({len(images)}, {', '.join(map(str, self.image_size))})")
            elif labels.ndim != 1 or labels.dtype.kind not in "iu" or len(labels) != len(images):
                raise self._fail(f"{split}/labels is {labels.dtype} {labels.shape}, "
                                 f"expected {len(images)} integers")
            self.sizes[split] = len(images)

    @property
    def dataset(self) -> str:
        return str(self._file.attrs["dataset"])

    @property
    def domain(self) -> str:
        return str(self._file.attrs["domain"])

    @property
    def source(self) -> str:
        return str(self._file.attrs["source"])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def content(self) -> str | None:
        """The :func:`content_digest` recorded when the shard was written (None: written before it existed)."""
        value = self._file.attrs.get(CONTENT)
        return str(value) if value is not None else None

    def labels(self, split: str) -> np.ndarray:
        """All labels of ``split`` (int64; masks uint8 N x H x W), checked to lie in 0..num_classes-1."""
        return self._checked(split, self._typed(self._dataset(split, "labels")[...]))

    def _typed(self, labels: np.ndarray) -> np.ndarray:
        return labels if self.task == "segmentation" else labels.astype(np.int64)

    def _dataset(self, split: str, key: str):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
        return self._file[split][key]

    def _checked(self, split: str, labels: np.ndarray) -> np.ndarray:
        if labels.size and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise self._fail(f"{split} labels span {labels.min()}..{labels.max()}, "
                             f"expected 0..{self.num_classes - 1}")
        return labels

    def load(self, split: str, indices=None) -> tuple[np.ndarray, np.ndarray]:
        """Images (uint8 NHWC) and labels (int64; masks uint8 N x H x W) of ``split``.

        ``indices`` (1-D ints, any order, repeats allowed) selects rows and
        returns them in that order.  HDF5 reads need increasing unique indices,
        so they are sorted and de-duplicated, read (as one slice when dense),
        then put back in the caller's order.
        """
        images, labels = self._dataset(split, "images"), self._dataset(split, "labels")
        if indices is None:
            x, y = images[...], labels[...]
        else:
            indices = np.asarray(indices)
            if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
                raise ValueError(f"indices must be a 1-D integer array, got {indices.dtype} {indices.shape}")
            if indices.size and (indices.min() < 0 or indices.max() >= len(images)):
                raise IndexError(f"indices outside 0..{len(images) - 1} of {self.path} {split}")
            order = indices.astype(np.int64)
            unique, inverse = np.unique(order, return_inverse=True)
            lo, hi = (int(unique[0]), int(unique[-1]) + 1) if unique.size else (0, 0)
            if hi - lo <= 2 * unique.size:  # dense (or empty): one contiguous read
                x, y = images[lo:hi][order - lo], labels[lo:hi][order - lo]
            else:
                x, y = images[unique][inverse], labels[unique][inverse]
        return x, self._checked(split, self._typed(y))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "Shard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Shard({str(self.path)!r}, sizes={self.sizes})"
