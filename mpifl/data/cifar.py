"""CIFAR-10 and CIFAR-10-C converters.

``python -m mpifl.data prepare cifar10 --src DIR [--size S] [--data-root ROOT]``
reads the python version of CIFAR-10 (``cifar-10-python.tar.gz`` unpacked):
``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and ``batches.meta``,
in ``--src`` or in ``--src/cifar-10-batches-py``.  These are pickles of
dicts (``data``: N x 3072 uint8, rows of R, G, B planes; ``labels``;
``label_names`` in ``batches.meta``), the only format in which the python
version ships, so they are unpickled, admitting numpy arrays and plain
containers only (:func:`~mpifl.data.arrays.load_array_pickle`).  One
domain ``cifar10``; test is ``test_batch``; val is a seeded stratified 10 %
of the 50,000 train images (an mpifl choice), rows kept in file order.
Classes are ``batches.meta``'s ``label_names``.

``python -m mpifl.data prepare cifar10c --src DIR [--severity 1..5]``
reads CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019): ``<corruption>.npy``
(50000 x 32 x 32 x 3 uint8: severities 1..5, 10,000 images each, in that
order) and ``labels.npy`` (50,000 labels), in ``--src`` or in
``--src/CIFAR-10-C``.  ``--severity`` (default 5) picks the 10,000-image
slice.  Each corruption present is one domain (only those present are
converted; an ``.npy`` that is no known corruption is an error).  Split:
seeded stratified 70/10/20 train/val/test per class (an mpifl choice: the
images are CIFAR-10's test set, which has no split).  The split depends
only on the image index, not on the corruption, so the same underlying
image is in the same split in every domain: no client trains on a
(differently corrupted) copy of another client's test image.  CIFAR-10-C
images are CIFAR-10's *test* images: do not evaluate a cifar10 model
trained with them on the cifar10 test split.

With ``--size`` other than 32 images are resized once with Pillow bilinear
(antialiased).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from mpifl.errors import MpiflError
from mpifl.data.arrays import (RESIZE_NOTE, ArrayDomain, carve_val, check_labels, check_size, load_array_pickle,
                               convert_arrays, seeded_split, split_rule, to_rgb)
from mpifl.data.manifest import DatasetManifest
from mpifl.data.splits import SPLIT_SEED

DEFAULT_SIZE = 32
VAL_FRACTION = 0.1
C_FRACTIONS = (0.7, 0.1, 0.2)
DEFAULT_SEVERITY = 5
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                   "truck"]
CORRUPTIONS = ("brightness", "contrast", "defocus_blur", "elastic_transform", "fog", "frost",
               "gaussian_blur", "gaussian_noise", "glass_blur", "impulse_noise", "jpeg_compression",
               "motion_blur", "pixelate", "saturate", "shot_noise", "snow", "spatter", "speckle_noise",
               "zoom_blur")
_PER_SEVERITY = 10_000


def _nolog(line: str) -> None:
    pass


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            data = load_array_pickle(f, path, "a CIFAR-10 batch", "unpack the official cifar-10-python.tar.gz "
                                     "again", encoding="bytes")
    except MpiflError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise MpiflError(f"cannot unpickle {path} ({type(e).__name__}: {e}); unpack "
                         "cifar-10-python.tar.gz again") from None
    if not isinstance(data, dict):
        raise MpiflError(f"{path} is not a CIFAR-10 batch (no dict); unpack cifar-10-python.tar.gz again")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in data.items()}


def _batch(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    data = _unpickle(path)
    if "data" not in data or "labels" not in data:
        raise MpiflError(f"{path} has no data and labels; unpack cifar-10-python.tar.gz again")
    pixels = np.asarray(data["data"])
    if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != 3072:
        raise MpiflError(f"{path}: data is {pixels.dtype} {pixels.shape}, expected uint8 N x 3072; unpack "
                         "cifar-10-python.tar.gz again")
    images = pixels.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, check_labels(data["labels"], len(images), num_classes, str(path))


def _locate(src: Path, names, sub: str, what: str) -> Path:
    for place in (src, src / sub):
        if all((place / n).is_file() for n in names):
            return place
    for place in (src, src / sub):
        present = [n for n in names if (place / n).is_file()]
        if present:
            missing = next(n for n in names if n not in present)
            raise MpiflError(f"{missing} is missing in {place}; unpack the complete {what} there")
    raise MpiflError(f"no {what} in {src}; pass --src DIR holding {names[0]} (or {sub}/)")


def prepare_cifar10(src, out, size: int | None = None,
                    log: Callable[[str], None] | None = None) -> DatasetManifest:
    """Convert CIFAR-10 (python batches) in ``src`` into ``<out>/cifar10``; return the manifest."""
    log = log or _nolog
    if src is None:
        raise MpiflError("cifar10 is converted from a download: pass --src DIR holding "
                         "cifar-10-batches-py (cifar-10-python.tar.gz unpacked)")
    src, out = Path(src), Path(out)
    size = check_size(size, DEFAULT_SIZE)
    train_names = [f"data_batch_{k}" for k in range(1, 6)]
    folder = _locate(src, [*train_names, "test_batch", "batches.meta"], "cifar-10-batches-py",
                     "CIFAR-10 python version")
    meta = _unpickle(folder / "batches.meta")
    classes = [c.decode() if isinstance(c, bytes) else str(c) for c in meta.get("label_names", [])]
    if len(classes) != 10 or len(set(classes)) != 10:
        raise MpiflError(f"{folder / 'batches.meta'} does not name 10 classes; unpack "
                         "cifar-10-python.tar.gz again")
    rule = (f"train = data_batch_1..5, test = test_batch; val = seeded stratified "
            f"{100 * VAL_FRACTION:g} % of train (seed {SPLIT_SEED})")

    def load():
        parts = [_batch(folder / n, 10) for n in train_names]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        train, val = carve_val(np.arange(len(labels)), labels, VAL_FRACTION, ("cifar10", "cifar10"))
        train, val = np.sort(train), np.sort(val)
        test_images, test_labels = _batch(folder / "test_batch", 10)
        return {"train": (to_rgb(images[train], size, "cifar10 train"), labels[train]),
                "val": (to_rgb(images[val], size, "cifar10 train"), labels[val]),
                "test": (to_rgb(test_images, size, "cifar10 test"), test_labels)}

    domain = ArrayDomain("cifar10", f"CIFAR-10 python batches in {folder.resolve()}; {rule}", load)
    protocol = {"clients_per_domain": 1, "split": rule,
                "split_origin": "CIFAR-10's train/test; val is an mpifl choice",
                "default_size": DEFAULT_SIZE, "size_origin": "CIFAR-10's 32x32",
                "resize": RESIZE_NOTE}
    return convert_arrays("cifar10", src, out, [domain], classes, size, "CIFAR-10 (Krizhevsky 2009)",
                          protocol, log)


def prepare_cifar10c(src, out, size: int | None = None, severity: int | None = None,
                     log: Callable[[str], None] | None = None) -> DatasetManifest:
    """Convert CIFAR-10-C at one ``severity`` in ``src`` into ``<out>/cifar10c``; return the manifest."""
    log = log or _nolog
    if src is None:
        raise MpiflError("cifar10c is converted from a download: pass --src DIR holding CIFAR-10-C's "
                         "<corruption>.npy and labels.npy")
    src, out = Path(src), Path(out)
    size = check_size(size, DEFAULT_SIZE)
    severity = DEFAULT_SEVERITY if severity is None else int(severity)
    if not 1 <= severity <= 5:
        raise MpiflError(f"severity {severity} is not 1..5; pass --severity between 1 and 5")
    folder = _locate(src, ["labels.npy"], "CIFAR-10-C", "CIFAR-10-C labels.npy")
    found = sorted(p for p in folder.glob("*.npy") if p.name != "labels.npy")
    unknown = [p.name for p in found if p.stem not in CORRUPTIONS]
    if unknown:
        raise MpiflError(f"unknown corruption file {unknown[0]} in {folder}; cifar10c knows "
                         f"{', '.join(CORRUPTIONS)}: rename or move it away")
    if not found:
        raise MpiflError(f"no <corruption>.npy next to {folder / 'labels.npy'}; put CIFAR-10-C's files there")
    names = [p.stem for p in found]
    log(f"cifar10c: severity {severity}, corruptions {', '.join(names)}")
    lo, hi = (severity - 1) * _PER_SEVERITY, severity * _PER_SEVERITY

    def _open(path: Path, shape_tail: tuple) -> np.ndarray:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise MpiflError(f"cannot read {path} ({e}); download CIFAR-10-C again") from None
        if array.shape[1:] != shape_tail or len(array) < hi:
            raise MpiflError(f"{path} has shape {array.shape}, expected (50000{', ' if shape_tail else ''}"
                             f"{', '.join(map(str, shape_tail))}) with severity {severity}'s rows "
                             f"{lo}..{hi - 1}; download CIFAR-10-C again")
        return array

    all_labels = _open(folder / "labels.npy", ())
    labels = check_labels(np.asarray(all_labels[lo:hi]), hi - lo, 10, str(folder / "labels.npy"))
    parts = seeded_split(labels, C_FRACTIONS, ("cifar10c",))
    rule = split_rule(C_FRACTIONS) + "; the same split in every corruption"

    def loader(path: Path):
        def load():
            images = _open(path, (32, 32, 3))
            if len(images) != len(all_labels):
                raise MpiflError(f"{path} has {len(images)} images but labels.npy has {len(all_labels)} "
                                 "labels; download CIFAR-10-C again")
            block = np.asarray(images[lo:hi])
            return {s: (to_rgb(block[i], size, str(path)), labels[i]) for s, i in zip(("train", "val", "test"),
                                                                                   parts)}
        return load

    domains = [ArrayDomain(p.stem, f"CIFAR-10-C {p.name} severity {severity} in {folder.resolve()}; {rule}",
                           loader(p)) for p in found]
    protocol = {"clients_per_domain": 1, "split": rule, "severity": severity,
                "split_origin": "mpifl choice (CIFAR-10-C has no split)",
                "default_size": DEFAULT_SIZE, "size_origin": "CIFAR-10's 32x32", "resize": RESIZE_NOTE,
                "note": "CIFAR-10-C images are CIFAR-10 test images: do not test cifar10 models trained "
                        "on them against the cifar10 test split"}
    return convert_arrays("cifar10c", src, out, domains, CIFAR10_CLASSES, size,
                          "CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019)", protocol, log)
