"""Fed-ISIC2019: ``python -m mpifl.data prepare isic2019 --src DIR [--size S] [--data-root ROOT]``.

Source: the ISIC 2019 challenge training images (BCN20000, HAM10000 and
MSK; Combalia et al. 2019, Tschandl et al. 2018, Codella et al. 2017) in
the layout of FLamby's Fed-ISIC2019 (Ogier du Terrail et al., NeurIPS 2022
Datasets and Benchmarks; https://github.com/owkin/FLamby): FLamby's
``download_isic.py`` fetches the images from
https://challenge.isic-archive.com/data/#2019 and its ``resize_images.py``
writes them, shorter side 224 px (aspect ratio kept) with colour
constancy, into ``ISIC_2019_Training_Input_preprocessed/``.  ``--src``
holds that folder and FLamby's split table ``train_test_split`` (a CSV
shipped in FLamby's ``flamby/datasets/fed_isic2019/dataset_creation_scripts/``:
copy it next to the folder; ``train_test_split.csv`` is accepted too)::

    train_test_split                                  image,...,target,center,fold,fold2
    ISIC_2019_Training_Input_preprocessed/ISIC_0000000.jpg
    ...

Of the table the converter reads ``image`` (the file is
``<image>.jpg``), ``target`` (class 0..7), ``center`` (0..5) and ``fold``
(``train`` or ``test``); where the table has them, FLamby's one-hot class
columns (``MEL`` .. ``SCC``, ``UNK``) and ``fold2`` (``<fold>_<center>``,
what FLamby's per-center loader selects on) must agree with those.  Every
listed image must exist and every center must have train and test images.

Classes, in ``target`` order (FLamby numbers ISIC's diagnosis columns):
MEL, NV, BCC, AK, BKL, DF, VASC, SCC.  Domains ``center0`` .. ``center5``
are FLamby's centers 0..5: BCN, HAM_vidir_molemax, HAM_vidir_modern,
HAM_rosendahl, MSK, HAM_vienna_dias (23,247 images in all).

**Split**: train and test are FLamby's (the table's ``fold``, about 80/20
in every center); val is a seeded stratified 10 % of each center's train
rows per class (seed :data:`~mpifl.data.folders.SPLIT_SEED`; an mpifl
choice, FLamby has no val).  Rows keep the table's order.

**Size**: 224 px by default, the preprocessed images' shorter side.  The
whole image is resized once to SxS (Pillow bilinear, antialiased, aspect
ratio not kept); FLamby's own loader instead crops 200x200 (at random for
train, the centre for test), which a run's augmentation can do.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from mpifl.errors import MpiflError
from mpifl.data.arrays import check_size
from mpifl.data.images import RESIZE_NOTE
from mpifl.data.listed import FileIndex, ListedDomain, csv_rows, write_listed
from mpifl.data.manifest import DatasetManifest
from mpifl.data.splits import SPLIT_SEED, split_rows
from mpifl.data.staging import check_target, source_dir

NAME = "isic2019"
CLASSES = ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC"]
#: FLamby's center ids 0..5, by the ISIC 2019 sub-dataset (and HAM10000 site) they come from.
CENTERS = ("BCN", "HAM_vidir_molemax", "HAM_vidir_modern", "HAM_rosendahl", "MSK", "HAM_vienna_dias")
DEFAULT_SIZE = 224
VAL_FRACTION = 0.1
IMAGES = "ISIC_2019_Training_Input_preprocessed"
TABLES = ("train_test_split", "train_test_split.csv")
_COLUMNS = ("image", "target", "center", "fold")
_ONE_HOT = (*CLASSES, "UNK")
_SOURCE = ("Fed-ISIC2019 of FLamby (Ogier du Terrail et al., NeurIPS 2022 Datasets and Benchmarks): the "
           "ISIC 2019 challenge training images (BCN20000, HAM10000, MSK) with FLamby's centers and "
           "train/test split")
_FIX = "use FLamby's fed_isic2019 train_test_split as shipped"
_UNREADABLE = ("preprocess the image again (FLamby's resize_images.py, from ISIC_2019_Training_Input) "
               "and run prepare again")


def domain_id(center: int) -> str:
    """The domain id of FLamby center ``center``."""
    return f"center{center}"


def find_table(src: Path) -> Path:
    """FLamby's split table in ``src``."""
    for name in TABLES:
        if (src / name).is_file():
            return src / name
    raise MpiflError(f"no train_test_split in {src}; copy it from FLamby's "
                     "flamby/datasets/fed_isic2019/dataset_creation_scripts/ next to "
                     f"{IMAGES}/ and pass that folder as --src")


def _number(where: str, column: str, value: str, count: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if not 0 <= number < count:
        what = {"target": "class", "center": "center"}[column]
        raise MpiflError(f"{where}: {column} is {value!r}, expected a {what} 0..{count - 1}; {_FIX}")
    return number


def _check_one_hot(where: str, values, target: int) -> None:
    """FLamby's one-hot diagnosis columns, where present, must mark class ``target`` only."""
    if all(v is None for v in values):
        return
    try:
        marks = [None if v is None else float(v) for v in values]
    except ValueError:
        raise MpiflError(f"{where}: the one-hot columns {', '.join(_ONE_HOT)} hold a non-number; "
                         f"{_FIX}") from None
    for column, mark in zip(_ONE_HOT, marks):
        if mark is not None and mark != (1.0 if column == CLASSES[target] else 0.0):
            raise MpiflError(f"{where}: target {target} is class {CLASSES[target]}, but column {column} is "
                             f"{mark:g}; the labels disagree: {_FIX}")


def scan(src: Path, table: Path) -> dict[int, dict]:
    """Center -> {"train": rows, "test": rows} of ``(image path, label)`` in table order, all checked."""
    images = src / IMAGES
    if not images.is_dir():
        raise MpiflError(f"no {IMAGES}/ folder in {src}; run FLamby's download_isic.py and resize_images.py "
                         "and pass the folder holding their output as --src")
    index, seen = FileIndex(), set()
    rows: dict[int, dict] = {c: {"train": [], "test": []} for c in range(len(CENTERS))}
    for where, values in csv_rows(table, _COLUMNS, _FIX, optional=(*_ONE_HOT, "fold2")):
        image, target, center, fold = values[:4]
        label = _number(where, "target", target, len(CLASSES))
        center = _number(where, "center", center, len(CENTERS))
        if fold not in ("train", "test"):
            raise MpiflError(f"{where}: fold is {fold!r}, expected train or test; {_FIX}")
        _check_one_hot(where, values[4:-1], label)
        if values[-1] is not None and values[-1] != f"{fold}_{center}":
            raise MpiflError(f"{where}: fold2 is {values[-1]!r} but fold and center say {fold}_{center}; "
                             f"the columns disagree: {_FIX}")
        path = images / f"{image}.jpg"
        if not image or path.parent != images or path not in index:
            raise MpiflError(f"{where} names image {image!r}, but {images} has no {image}.jpg; run FLamby's "
                             "resize_images.py to completion (or restore the file)")
        if path in seen:
            raise MpiflError(f"{where} repeats image {image}; {_FIX}")
        seen.add(path)
        rows[center][fold].append((path, label))
    for center, folds in rows.items():
        for fold, fold_rows in folds.items():
            if not fold_rows:
                raise MpiflError(f"{table} lists no {fold} image of center {center} ({CENTERS[center]}); "
                                 f"Fed-ISIC2019 has train and test images in centers 0..{len(CENTERS) - 1}: "
                                 f"{_FIX}")
    return rows


def prepare_isic2019(src, out, size: int | None = None,
                     log: Callable[[str], None] | None = None) -> DatasetManifest:
    """Convert Fed-ISIC2019 (FLamby's preprocessed images and split) in ``src`` into ``<out>/isic2019``."""
    log = log or (lambda line: None)
    src, out = source_dir(NAME, src, f"{IMAGES}/ and FLamby's train_test_split"), Path(out)
    size = check_size(size, DEFAULT_SIZE)
    check_target(out / NAME, src)
    started = time.monotonic()
    table = find_table(src)
    rows = scan(src, table)
    rule = (f"FLamby's train_test_split: train/test = its fold column; val = seeded stratified "
            f"{100 * VAL_FRACTION:g} % of each center's train rows per class (seed {SPLIT_SEED})")
    total = sum(len(r) for folds in rows.values() for r in folds.values())
    log(f"{NAME}: {len(CENTERS)} centers, {len(CLASSES)} classes, {total} images; {rule}")
    domains = []
    for center, folds in rows.items():
        train, val = split_rows(folds["train"], CLASSES, (1 - VAL_FRACTION, VAL_FRACTION),
                                (NAME, domain_id(center), "val"))
        domains.append(ListedDomain(domain_id(center), f"Fed-ISIC2019, FLamby center {center} "
                                                       f"({CENTERS[center]}) of {table.resolve()}; {rule}",
                                    {"train": train, "val": val, "test": folds["test"]},
                                    shown=f" ({CENTERS[center]})", fix=_UNREADABLE))
    protocol = {"clients_per_domain": 1, "split": rule,
                "split_origin": "FLamby's Fed-ISIC2019 train/test split; val is an mpifl choice",
                "centers": {domain_id(c): name for c, name in enumerate(CENTERS)},
                "default_size": DEFAULT_SIZE,
                "size_origin": ("the shorter side of FLamby's preprocessed images (its loader crops "
                                "200x200)"),
                "resize": RESIZE_NOTE}
    return write_listed(NAME, src, out, domains, CLASSES, size, _SOURCE, protocol, log, started)
