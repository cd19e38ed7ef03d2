"""Camelyon17-WILDS: ``python -m mpifl.data prepare camelyon17 --src DIR [--size S] [--data-root ROOT]``.

Source: Camelyon17-WILDS v1.0 (Koh et al., WILDS, ICML 2021): 455,954
patches of 96x96 RGB from lymph-node slides of the CAMELYON17 challenge
(Bandi et al., IEEE TMI 2019), from 5 hospitals, downloaded from
https://wilds.stanford.edu/datasets/ (``camelyon17_v1.0.tar.gz``) and
unpacked::

    camelyon17_v1.0/metadata.csv
    camelyon17_v1.0/patches/patient_004_node_4/patch_patient_004_node_4_x_3328_y_21792.png
    ...

``--src`` is the folder holding ``metadata.csv`` or its parent.  Of
``metadata.csv`` the converter reads ``patient``, ``node``, ``x_coord`` and
``y_coord`` (they name the patch file, as in WILDS' loader), ``tumor`` (the
label: ``normal`` = 0, ``tumor`` = 1 when the patch's central 32x32 region
holds tumour tissue) and ``center`` (the hospital 0..4, WILDS' 0-based
numbering: domains ``hospital0`` .. ``hospital4``); ``slide`` and ``split``
are not used.  Every listed patch must exist, every hospital must have
patches, and a value out of range is an error naming the line.

**Split** (an mpifl choice, for hospital-as-client FL): per hospital, a
seeded stratified 70/10/20 train/val/test split per label (seed
:data:`~mpifl.data.folders.SPLIT_SEED`), so every client trains and is
tested on its own hospital, as FL work that makes each hospital a client
does; within a split, rows keep ``metadata.csv`` order.  Patches are split
one by one, so a slide's patches fall into every split.  WILDS' ``split``
column and hospital split (train on hospitals 0, 3, 4, OOD val 1, test 2)
are a domain-generalization protocol, not used here; for that kind of
experiment run with ``--holdout hospital2``.

**Size**: 96 px by default, the patches' own size (they are not resampled;
WILDS trains its DenseNet-121 at 96x96); another ``--size`` resizes once
(Pillow bilinear, antialiased).  All patches take about 12.6 GB at 96 px.
The table is read row by row and the patches are decoded and written in
bounded batches, never all in memory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from mpifl.errors import MpiflError
from mpifl.data.arrays import check_size, visible_dirs
from mpifl.data.images import RESIZE_NOTE
from mpifl.data.listed import FileIndex, ListedDomain, csv_rows, write_listed
from mpifl.data.manifest import DatasetManifest
from mpifl.data.shard import SPLITS
from mpifl.data.splits import SPLIT_SEED, split_rows
from mpifl.data.staging import check_target, source_dir

NAME = "camelyon17"
CLASSES = ["normal", "tumor"]
HOSPITALS = 5
DEFAULT_SIZE = 96
FRACTIONS = (0.7, 0.1, 0.2)
METADATA = "metadata.csv"
FOLDER = "camelyon17_v1.0"
_COLUMNS = ("patient", "node", "x_coord", "y_coord", "tumor", "center")
_TITLE = "Camelyon17-WILDS v1.0"
_SOURCE = ("Camelyon17-WILDS v1.0 (Koh et al., WILDS, ICML 2021), patches of the CAMELYON17 challenge "
           "slides (Bandi et al., IEEE TMI 2019)")
_FIX = "use metadata.csv and patches/ of camelyon17_v1.0 as downloaded from WILDS"
_UNREADABLE = "unpack the patch again from camelyon17_v1.0.tar.gz and run prepare again"


def domain_id(center: int) -> str:
    """The domain id of WILDS hospital ``center`` (0-based)."""
    return f"hospital{center}"


def find_metadata(src: Path) -> Path:
    """The folder holding ``metadata.csv``: ``src``, its ``camelyon17_v1.0``, or its one folder with
    ``metadata.csv`` and ``patches/`` (other WILDS datasets have a ``metadata.csv`` too)."""
    for folder in (src, src / FOLDER):
        if (folder / METADATA).is_file():
            return folder
    below = [d for d in visible_dirs(src) if (d / METADATA).is_file() and (d / "patches").is_dir()]
    if len(below) > 1:
        raise MpiflError(f"several folders in {src} hold a {METADATA} ({', '.join(d.name for d in below)}); "
                         "point --src at the one of camelyon17_v1.0")
    if not below:
        raise MpiflError(f"no {METADATA} in {src} or a folder below it; pass --src DIR holding "
                         "camelyon17_v1.0/ (its metadata.csv and patches/), unpacked from WILDS' "
                         "camelyon17_v1.0.tar.gz")
    return below[0]


def _number(where: str, column: str, value: str, lo: int, hi: int | None = None) -> int:
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < lo or (hi is not None and number > hi):
        expected = {"tumor": "0 or 1", "center": f"a hospital 0..{HOSPITALS - 1}"}.get(
            column, f"an integer >= {lo}")
        raise MpiflError(f"{where}: {column} is {value!r}, expected {expected}; {_FIX}")
    return number


def scan(folder: Path) -> dict[int, list]:
    """Hospital -> its ``(patch path, label)`` rows in table order, every patch checked to exist."""
    metadata, patches = folder / METADATA, folder / "patches"
    if not patches.is_dir():
        raise MpiflError(f"no patches/ folder next to {metadata}; unpack the complete camelyon17_v1.0 "
                         "archive there")
    index, seen = FileIndex(), set()
    rows: dict[int, list] = {c: [] for c in range(HOSPITALS)}
    for where, (patient, node, x, y, tumor, center) in csv_rows(metadata, _COLUMNS, _FIX):
        p, n = _number(where, "patient", patient, 0), _number(where, "node", node, 0)
        x, y = _number(where, "x_coord", x, 0), _number(where, "y_coord", y, 0)
        label = _number(where, "tumor", tumor, 0, 1)
        hospital = _number(where, "center", center, 0, HOSPITALS - 1)
        slide = f"patient_{p:03d}_node_{n}"
        name = f"{slide}/patch_{slide}_x_{x}_y_{y}.png"
        path = os.path.join(patches, name)
        if path not in index:
            raise MpiflError(f"{where} names patch {name}, which is not in {patches}; unpack the complete "
                             "camelyon17_v1.0 archive (or use its own metadata.csv)")
        if path in seen:
            raise MpiflError(f"{where} repeats patch {name}; {_FIX}")
        seen.add(path)
        rows[hospital].append((path, label))
    empty = [c for c, r in rows.items() if not r]
    if empty:
        raise MpiflError(f"{metadata} lists no patch of hospital {empty[0]} (center {empty[0]}); "
                         f"Camelyon17-WILDS has hospitals 0..{HOSPITALS - 1}: {_FIX}")
    return rows


def prepare_camelyon17(src, out, size: int | None = None,
                       log: Callable[[str], None] | None = None) -> DatasetManifest:
    """Convert Camelyon17-WILDS in ``src`` into ``<out>/camelyon17``; return the manifest."""
    log = log or (lambda line: None)
    src, out = source_dir(NAME, src, "camelyon17_v1.0/ (metadata.csv and patches/) from WILDS"), Path(out)
    size = check_size(size, DEFAULT_SIZE)
    check_target(out / NAME, src)
    started = time.monotonic()
    folder = find_metadata(src)
    rows = scan(folder)
    rule = (f"seeded stratified split per hospital and label: train/val/test = "
            f"{'/'.join(f'{100 * f:g}' for f in FRACTIONS)} % (seed {SPLIT_SEED})")
    total = sum(len(r) for r in rows.values())
    log(f"{NAME}: {HOSPITALS} hospitals, {total} patches; {rule}")
    domains = []
    for hospital, hospital_rows in rows.items():
        parts = split_rows(hospital_rows, CLASSES, FRACTIONS, (NAME, domain_id(hospital)))
        domains.append(ListedDomain(domain_id(hospital), f"{_TITLE}, hospital {hospital} (center {hospital} "
                                                         f"in {(folder / METADATA).resolve()}); {rule}",
                                    dict(zip(SPLITS, parts)), fix=_UNREADABLE))
    protocol = {"clients_per_domain": 1, "split": rule,
                "split_origin": ("mpifl choice for hospital-as-client FL (each client tested on its own "
                                 "hospital); WILDS' split column (a domain-generalization protocol: test "
                                 "hospital 2, OOD val hospital 1) is not used, see --holdout"),
                "default_size": DEFAULT_SIZE, "size_origin": "the patches' own 96x96, as WILDS trains",
                "resize": RESIZE_NOTE}
    return write_listed(NAME, src, out, domains, CLASSES, size, _SOURCE, protocol, log, started)
