"""FairFace: ``python -m mpifl.data prepare fairface --src DIR [--size S] [--data-root ROOT]``.

Source: FairFace (Karkkainen & Joo, WACV 2021; https://github.com/joojs/fairface),
face crops of YFCC-100M photos balanced over 7 race groups, as downloaded
from the links on that page: the label tables and the images with padding
0.25 (``fairface-img-margin025-trainval.zip``, 224x224) unpacked next to
them::

    fairface_label_train.csv     file,age,gender,race,service_test
    fairface_label_val.csv
    train/1.jpg ...
    val/1.jpg ...

``file`` is the image's path relative to ``--src``.  Label = ``gender``
(classes ``Male`` = 0, ``Female`` = 1).  Domain = ``race``, one per group,
with filesystem-safe ids: White -> ``white``, Black -> ``black``,
Latino_Hispanic -> ``latino_hispanic``, East Asian -> ``east_asian``,
Southeast Asian -> ``southeast_asian``, Indian -> ``indian``, Middle
Eastern -> ``middle_eastern``.  ``age`` and ``service_test`` are not used.
Every listed image must exist; another gender or race is an error naming
the line.

**Split**: test = the official val table (FairFace has no test split); val
= a seeded stratified 10 % of each domain's rows of the official train table
per class (seed :data:`~mpifl.data.folders.SPLIT_SEED`; an mpifl choice),
train = the rest.  Rows keep the tables' order.

**Size**: 224 px by default, the released images' own size (not resampled)
and the usual ImageNet-backbone input; another ``--size`` resizes once
(Pillow bilinear, antialiased).
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

NAME = "fairface"
CLASSES = ["Male", "Female"]
#: FairFace's race values -> domain ids.
RACES = {"White": "white", "Black": "black", "Latino_Hispanic": "latino_hispanic", "East Asian": "east_asian",
         "Southeast Asian": "southeast_asian", "Indian": "indian", "Middle Eastern": "middle_eastern"}
DEFAULT_SIZE = 224
VAL_FRACTION = 0.1
TABLES = {"train": "fairface_label_train.csv", "test": "fairface_label_val.csv"}
_COLUMNS = ("file", "gender", "race")
_SOURCE = ("FairFace (Karkkainen & Joo: FairFace: Face Attribute Dataset for Balanced Race, Gender, and "
           "Age, WACV 2021)")
_FIX = "use FairFace's label tables as downloaded"
_UNREADABLE = "unpack the image again from FairFace's image zip and run prepare again"
_RACE_OF = {domain: race for race, domain in RACES.items()}


def scan(src: Path) -> dict[str, dict]:
    """Domain id -> {"train": rows, "test": rows} of ``(image path, label)`` in table order, all checked."""
    for table in TABLES.values():
        if not (src / table).is_file():
            raise MpiflError(f"{table} is missing in {src}; put FairFace's fairface_label_train.csv and "
                             "fairface_label_val.csv next to the unpacked train/ and val/ image folders "
                             "and pass that folder as --src")
    index, seen = FileIndex(), set()
    rows: dict[str, dict] = {d: {"train": [], "test": []} for d in sorted(RACES.values())}
    for split, table in TABLES.items():
        for where, (file, gender, race) in csv_rows(src / table, _COLUMNS, _FIX):
            if gender not in CLASSES:
                raise MpiflError(f"{where}: gender is {gender!r}, expected Male or Female; {_FIX}")
            if race not in RACES:
                raise MpiflError(f"{where}: unknown race {race!r}, expected one of {', '.join(RACES)}; "
                                 f"{_FIX}")
            relative = Path(file)
            path = src / relative
            if not file or relative.is_absolute() or ".." in relative.parts or path not in index:
                raise MpiflError(f"{where} names image {file!r}, which is not in {src}; unpack "
                                 "fairface-img-margin025-trainval.zip there (train/ and val/)")
            if path in seen:
                raise MpiflError(f"{where} repeats image {file}; {_FIX}")
            seen.add(path)
            rows[RACES[race]][split].append((path, CLASSES.index(gender)))
    for domain, splits in rows.items():
        for split, listed in splits.items():
            if not listed:
                table = TABLES[split]
                raise MpiflError(f"{src / table} lists no image of race {_RACE_OF[domain]!r}; FairFace has "
                                 f"all 7 races in both tables: {_FIX}")
    return rows


def prepare_fairface(src, out, size: int | None = None,
                     log: Callable[[str], None] | None = None) -> DatasetManifest:
    """Convert FairFace in ``src`` into ``<out>/fairface``; return the manifest."""
    log = log or (lambda line: None)
    src, out = source_dir(NAME, src, "fairface_label_train.csv, fairface_label_val.csv, train/ and val/"), Path(out)
    size = check_size(size, DEFAULT_SIZE)
    check_target(out / NAME, src)
    started = time.monotonic()
    rows = scan(src)
    rule = (f"test = fairface_label_val.csv; val = seeded stratified {100 * VAL_FRACTION:g} % of each "
            f"domain's fairface_label_train.csv rows per class (seed {SPLIT_SEED}), train = the rest")
    total = sum(len(r) for splits in rows.values() for r in splits.values())
    log(f"{NAME}: {len(rows)} race domains, {total} images; {rule}")
    domains = []
    for domain, splits in rows.items():
        race = _RACE_OF[domain]
        train, val = split_rows(splits["train"], CLASSES, (1 - VAL_FRACTION, VAL_FRACTION),
                                (NAME, domain, "val"))
        domains.append(ListedDomain(domain, f"FairFace, race '{race}' in {src.resolve()}; {rule}",
                                    {"train": train, "val": val, "test": splits["test"]},
                                    fix=_UNREADABLE))
    protocol = {"clients_per_domain": 1, "split": rule,
                "split_origin": ("FairFace's train/val tables (its val serves as test); val is an mpifl "
                                 "choice"),
                "label": "gender", "domain": "race",
                "default_size": DEFAULT_SIZE,
                "size_origin": "the released padding-0.25 images' own 224x224",
                "resize": RESIZE_NOTE}
    return write_listed(NAME, src, out, domains, CLASSES, size, _SOURCE, protocol, log, started)
