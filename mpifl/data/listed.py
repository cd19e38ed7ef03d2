"""Writing image files listed per domain and split as shards: the end of every image converter.

The image-folder converter (:mod:`mpifl.data.folders`) and the converters of image files listed in a CSV
table (:mod:`mpifl.data.camelyon`, :mod:`mpifl.data.isic`, :mod:`mpifl.data.fairface`) end with
:func:`write_listed`; the CSV ones read their tables with :func:`csv_rows` and check files exist with
:class:`FileIndex`.
"""

from __future__ import annotations

import csv
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from mpifl.errors import MpiflError
from mpifl.data.images import decoded_batches, workers
from mpifl.data.manifest import DatasetManifest, build_manifest
from mpifl.data.shard import SPLITS, ShardWriter
from mpifl.data.staging import staged_dataset

#: Decoded pixels per batch handed to the writer (two batches are decoded ahead).
BATCH_BYTES = 32 << 20


@dataclass(frozen=True)
class ListedDomain:
    """One domain of image files to write as a shard.

    ``rows`` maps every split to its ``(path, label)`` rows, in the order they
    are written; ``source`` is the shard's ``source`` attribute.  ``shown`` and
    ``note`` go into the progress line, after the domain id and after the
    split sizes.  ``fix`` is the remedy for an unreadable image (default:
    replace or delete the file).
    """

    id: str
    source: str
    rows: dict
    shown: str = ""
    note: str = ""
    fix: str | None = None


def csv_rows(path: Path, columns, fix: str, optional=()) -> Iterator[tuple[str, tuple]]:
    """Yield ``(where, values)`` for every non-blank data row of the CSV file ``path``.

    The header must name every one of ``columns``; ``values`` holds their
    fields, stripped, then those of the ``optional`` columns (``None`` where
    the header lacks one); other columns are ignored.  ``where`` is
    ``"<path> line <n>"`` for error messages.  An unreadable file, a missing
    column or a row with more or fewer fields than the header is an
    :class:`MpiflError` ending in ``fix``.
    """
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = [name.strip() for name in next(reader, [])]
            missing = [c for c in columns if c not in header]
            if missing:
                have = f"its columns: {', '.join(header)}" if header else "it is empty"
                raise MpiflError(f"{path} has no column '{missing[0]}' ({have}); {fix}")
            index = [header.index(c) if c in header else None for c in (*columns, *optional)]
            for fields in reader:
                if not any(field.strip() for field in fields):
                    continue
                where = f"{path} line {reader.line_num}"
                if len(fields) != len(header):
                    raise MpiflError(f"{where} has {len(fields)} fields, its header {len(header)}; {fix}")
                yield where, tuple(None if i is None else fields[i].strip() for i in index)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise MpiflError(f"cannot read {path} ({type(e).__name__}: {e}); {fix}") from None


class FileIndex:
    """Whether listed files exist, from one directory listing per folder.

    Cheaper than a ``stat`` per file when a table lists hundreds of
    thousands of files (Camelyon17's patches), notably on network file systems.
    """

    def __init__(self):
        self._names: dict[str, frozenset] = {}

    def __contains__(self, path) -> bool:
        folder, name = os.path.split(os.fspath(path))
        names = self._names.get(folder)
        if names is None:
            try:
                names = frozenset(os.listdir(folder or "."))
            except OSError:
                names = frozenset()
            self._names[folder] = names
        return name in names


def write_listed(name: str, src, out, domains, classes, size: int, source: str, protocol: dict,
                 log: Callable[[str], None], started: float | None = None) -> DatasetManifest:
    """Decode the image files ``domains`` list and write shards + manifest into ``<out>/<name>``.

    The converters whose sources are image files (the image folders of
    :mod:`mpifl.data.folders`, and the CSV-listed Camelyon17, ISIC 2019 and
    FairFace) end with this: a thread pool decodes and resizes
    (:func:`~mpifl.data.images.load_image`) at most two batches of about
    :data:`BATCH_BYTES` ahead of the shard writer, so memory stays bounded
    whatever the domain's size, and everything is written inside
    :func:`~mpifl.data.staging.staged_dataset` (installed whole or not at all).
    ``started`` is when the conversion began (for the final timing line).
    """
    src, out = Path(src), Path(out)
    started = time.monotonic() if started is None else started
    total = sum(len(rows) for d in domains for rows in d.rows.values())
    with staged_dataset(out, name, src) as built:
        batch = max(16, min(4096, BATCH_BYTES // (size * size * 3)))
        with ThreadPoolExecutor(max_workers=workers()) as pool:
            try:
                for domain in domains:
                    _write_domain(name, domain, classes, built, size, pool, batch, log)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        build_manifest(built.parent, name, source=f"{source}; converted from {src.resolve()}",
                       protocol=protocol)
    log(f"{name}: converted {total} images at {size}x{size} in {time.monotonic() - started:.1f} s")
    return DatasetManifest.load(out, name)


def _write_domain(name: str, domain: ListedDomain, classes, directory: Path, size, pool, batch, log) -> None:
    started = time.monotonic()
    with ShardWriter(directory / f"{domain.id}.h5", dataset=name, domain=domain.id, classes=classes,
                     image_size=(size, size), channels=3, source=domain.source) as writer:
        for split in SPLITS:
            for images, labels in decoded_batches(pool, domain.rows[split], size, batch, domain.fix):
                writer.add(split, images, labels)
    sizes = "/".join(str(len(domain.rows[s])) for s in SPLITS)
    log(f"{name}: {domain.id}{domain.shown} train/val/test {sizes}{domain.note} "
        f"in {time.monotonic() - started:.1f} s")
