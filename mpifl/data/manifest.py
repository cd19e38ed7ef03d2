"""``manifest.json``: what a dataset directory holds, and the checks against it.

A dataset lives in ``<root>/<name>/``: one shard per domain (``<domain>.h5``,
see :mod:`mpifl.data.shard`) and a ``manifest.json`` that lists the domains,
classes, image size, split sizes, default normalization, protocol defaults
and, per shard, its file name, size, sha256 and ``content`` (the content checksum the shard carries,
:func:`~mpifl.data.shard.content_digest`).  :func:`build_manifest` writes
it from the shards; :func:`open_shard` opens a shard after cheap agreement
checks (sizes, classes, file length, and that it is the shard the manifest was written with: its content
checksum, an attribute read, against the manifest's); :func:`verify` does the full check
including checksums.  A dataset prepared before shards carried a content checksum (its manifest records
none) is checked by its files' sha256 instead, each file read in full once per process that opens it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpifl.errors import MpiflError
from mpifl.data.names import CLASS_NAME, PLAIN_NAME, is_class_name, is_plain_name
from mpifl.data.shard import FORMAT_VERSION, SPLITS, TASKS, Shard

MANIFEST = "manifest.json"
#: Datasets mpifl builds itself on first use (:mod:`mpifl.data.generated`, :mod:`mpifl.data.shapes`):
#: the fix for a damaged one is to delete it, not to run a converter.
GENERATED = ("styledigits", "styleshapes")

def check_name(name: str) -> str:
    """Reject dataset names that are not a plain directory name."""
    if not is_plain_name(name):
        raise MpiflError(f"bad dataset name {name!r}; use {PLAIN_NAME}")
    return name


def remedy(root, name: str) -> str:
    """How the user rebuilds dataset ``name`` under ``root``."""
    if name in GENERATED:
        return f"delete {Path(root) / name} to regenerate it"
    return f"run `python -m mpifl.data prepare {name} --src DIR --data-root {root}`"


@dataclass
class DatasetManifest:
    """The parsed ``manifest.json`` of one dataset directory."""

    name: str
    domains: list[str]
    classes: list[str]
    image_size: tuple[int, int]  # (H, W)
    channels: int
    splits: dict[str, dict[str, int]]  # domain -> {"train": n, "val": n, "test": n}
    normalize: dict[str, list[float]]  # {"mean": [...], "std": [...]}, one value per channel
    shards: dict[str, dict]  # domain -> {"file": "<domain>.h5", "sha256": hex, "bytes": n, "content": hex}
    source: str
    protocol: dict = field(default_factory=dict)  # protocol defaults, e.g. clients_per_domain
    format_version: int = FORMAT_VERSION
    task: str = "classification"  # or "segmentation": labels are masks (mpifl.data.shard)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def _known(self, domain: str) -> str:
        if domain not in self.domains:
            raise MpiflError(f"dataset {self.name} has no domain {domain!r}; "
                             f"choose from {', '.join(self.domains)}")
        return domain

    def split_sizes(self, domain: str) -> dict:
        """``{"train": n, "val": n, "test": n}`` for ``domain``."""
        return dict(self.splits[self._known(domain)])

    def shard_path(self, root, domain: str) -> Path:
        return Path(root) / self.name / self.shards[self._known(domain)]["file"]

    def write(self, root) -> Path:
        """Write ``<root>/<name>/manifest.json`` atomically (temp file + rename)."""
        path = Path(root) / self.name / MANIFEST
        data = dataclasses.asdict(self)
        problem = _schema_problem(data, self.name)
        if problem:
            raise MpiflError(f"refusing to write an invalid manifest {path}: {problem}; "
                             "fix the values passed to build_manifest")
        data["image_size"] = list(self.image_size)
        tmp = path.with_name(f"{MANIFEST}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, root, name: str) -> "DatasetManifest":
        """Read and validate ``<root>/<name>/manifest.json``."""
        check_name(name)
        directory = Path(root) / name
        path = directory / MANIFEST
        fix = remedy(root, name)
        if not directory.is_dir():
            if name in GENERATED:
                fix = f"run `python -m mpifl.data prepare {name} --data-root {root}` to generate it"
            raise MpiflError(f"dataset '{name}' not found under {root}; {fix}")
        if not path.is_file():
            raise MpiflError(f"manifest missing: {path}; {fix}")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise MpiflError(f"manifest {path} is not readable JSON ({e}); {fix}") from None
        if isinstance(data, dict):
            data.setdefault("task", "classification")  # written before tasks existed
        problem = _schema_problem(data, name)
        if problem:
            raise MpiflError(f"manifest {path}: {problem}; {fix}")
        data["image_size"] = tuple(data["image_size"])
        return cls(**data)


def _schema_problem(data, name: str) -> str | None:
    """The first thing wrong with a decoded manifest, or None."""
    if not isinstance(data, dict):
        return "top level is not an object"
    keys = {f.name for f in dataclasses.fields(DatasetManifest)}
    if set(data) - keys:
        return f"unknown keys {', '.join(sorted(set(data) - keys))}"
    if keys - set(data):
        return f"missing keys {', '.join(sorted(keys - set(data)))}"
    if data["format_version"] != FORMAT_VERSION:
        return f"format version {data['format_version']}, this mpifl reads version {FORMAT_VERSION}"
    if data["name"] != name:
        return f"name is {data['name']!r} but the directory is {name!r}"
    domains, channels, classes = data["domains"], data["channels"], data["classes"]
    checks = [
        (isinstance(domains, list) and domains and all(isinstance(d, str) for d in domains)
         and len(set(domains)) == len(domains), "domains must be a non-empty list of unique names"),
        (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes),
         "classes must be a non-empty list of names"),
        (isinstance(data["splits"], dict) and isinstance(data["shards"], dict),
         "splits and shards must be objects keyed by domain"),
        (isinstance(data["image_size"], (list, tuple)) and len(data["image_size"]) == 2
         and all(_is_int(v) and v > 0 for v in data["image_size"]), "image_size must be [H, W]"),
        (_is_int(channels) and channels > 0, "channels must be a positive integer"),
        (isinstance(data["source"], str), "source must be a string"),
        (isinstance(data["protocol"], dict), "protocol must be an object"),
        (data["task"] in TASKS, f"task must be one of {', '.join(TASKS)}"),
    ]
    for ok, problem in checks:
        if not ok:
            return problem
    for name in classes:
        if not is_class_name(name):
            return f"class {name!r} is not a plain name ({CLASS_NAME})"
    for domain in domains:
        if not is_plain_name(domain):
            return f"domain {domain!r} is not a plain name ({PLAIN_NAME})"
        sizes, shard = data["splits"].get(domain), data["shards"].get(domain)
        if not (isinstance(sizes, dict) and set(sizes) == set(SPLITS)
                and all(_is_int(n) and n >= 0 for n in sizes.values())):
            return f"splits of domain {domain} must give train, val and test sizes"
        if not (isinstance(shard, dict) and set(shard) - {"content"} == {"file", "sha256", "bytes"}
                and isinstance(shard["sha256"], str) and _is_int(shard["bytes"])
                and isinstance(shard.get("content", ""), str)):
            return f"shards entry of domain {domain} must give file, sha256, bytes and content"
        if shard["file"] != f"{domain}.h5":
            return f"shards entry of domain {domain} must name the file {domain}.h5, not {shard['file']!r}"
    if set(data["splits"]) != set(domains) or set(data["shards"]) != set(domains):
        return "splits and shards must list exactly the domains"
    norm = data["normalize"]
    if not (isinstance(norm, dict) and set(norm) == {"mean", "std"}
            and all(isinstance(norm[k], list) and len(norm[k]) == channels
                    and all(_is_number(v) for v in norm[k]) for k in norm)
            and all(v > 0 for v in norm["std"])):
        return f"normalize must give mean and positive std lists of {channels} numbers"
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pooled_normalization(stats) -> dict:
    """Mean/std over the union of several domains' train pixels.

    ``stats`` is ``[(n_train, mean, std), ...]`` per domain, with per-channel
    mean/std arrays.  Weights are train sizes (domains share the image size,
    so image counts weigh pixels equally); the pooled variance is
    ``sum n_i (std_i^2 + mean_i^2) / N - mean^2``.  Empty domains are skipped.
    """
    stats = [(n, np.asarray(m, np.float64), np.asarray(s, np.float64)) for n, m, s in stats if n > 0]
    total = sum(n for n, _, _ in stats)
    mean = sum(n * m for n, m, _ in stats) / total
    second = sum(n * (s ** 2 + m ** 2) for n, m, s in stats) / total
    return {"mean": mean.tolist(), "std": np.sqrt(np.maximum(second - mean ** 2, 0.0)).tolist()}


def build_manifest(root, name: str, source: str, protocol: dict, normalize: dict | None = None
                   ) -> DatasetManifest:
    """Scan ``<root>/<name>/*.h5``, check the shards agree, write ``manifest.json``.

    Domains are the shard file stems, in sorted order.  ``normalize`` defaults
    to the mean/std pooled over all domains' train images.
    """
    check_name(name)
    directory = Path(root) / name
    fix = remedy(root, name)
    paths = sorted(directory.glob("*.h5"))
    if not paths:
        raise MpiflError(f"no shards (*.h5) in {directory}; {fix}")
    first = None
    splits, shards, stats = {}, {}, []
    for path in paths:
        domain = path.stem
        with Shard(path, fix) as shard:
            layout = (shard.classes, shard.image_size, shard.channels, shard.task)
            if shard.dataset != name or shard.domain != domain:
                raise MpiflError(f"shard {path} says dataset {shard.dataset!r} domain {shard.domain!r}, "
                                 f"expected {name!r} {domain!r}; rename the file or re-run the converter")
            if first is None:
                first = layout
            elif layout != first:
                raise MpiflError(f"shard of domain {domain} ({path}) disagrees with {paths[0].stem} on "
                                 f"classes, image size, channels or task; {fix}")
            splits[domain] = dict(shard.sizes)
            stats.append((shard.sizes["train"], shard.mean, shard.std))
            content = shard.content
        shards[domain] = {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size}
        if content is not None:  # every shard this mpifl writes has one
            shards[domain]["content"] = content
    if normalize is None:
        if not any(n for n, _, _ in stats):
            raise MpiflError(f"no train images in {directory} to compute normalization from; "
                             "pass normalize explicitly or add train data")
        normalize = pooled_normalization(stats)
    normalize = {"mean": [float(v) for v in normalize["mean"]], "std": [float(v) for v in normalize["std"]]}
    classes, image_size, channels, task = first
    manifest = DatasetManifest(name=name, domains=list(splits), classes=list(classes),
                               image_size=tuple(image_size), channels=channels, splits=splits,
                               normalize=normalize, shards=shards, source=source,
                               protocol=dict(protocol), task=task)
    manifest.write(root)
    return manifest


def build_of(manifest: DatasetManifest) -> dict:
    """What tells one build of a dataset from another (a checkpoint records it): its image size, each shard's
    sha256 and, where the manifest records them, each shard's content checksum, as ``prepare`` wrote them."""
    build = {"image_size": list(manifest.image_size),
             "shards": {domain: manifest.shards[domain]["sha256"] for domain in manifest.domains}}
    if all("content" in manifest.shards[domain] for domain in manifest.domains):
        build["content"] = {domain: manifest.shards[domain]["content"] for domain in manifest.domains}
    return build


def build_difference(before: dict, now: dict) -> str | None:
    """How build ``now`` differs from ``before`` (:func:`build_of`), in a few words; None when it is the same.
    The shards' content checksums decide where both record them (the same images written again by another
    mpifl are the same build), else their files' sha256."""
    if before["image_size"] != now["image_size"]:
        return "images {}x{}, now {}x{}".format(*before["image_size"], *now["image_size"])
    key, what = ("content", "content sha256") if "content" in before and "content" in now else ("shards", "sha256")
    domains = set(before[key]) | set(now[key])
    changed = sorted(d for d in domains if before[key].get(d) != now[key].get(d))
    return f"other shards of {', '.join(changed)} ({what})" if changed else None


def _disagreement(manifest: DatasetManifest, domain: str, shard: Shard) -> str | None:
    """What a shard's own name, sizes, classes or shape contradict in the manifest, or None."""
    if (shard.dataset, shard.domain) != (manifest.name, domain):  # another domain's file copied over this one
        return f"it says it is dataset {shard.dataset!r} domain {shard.domain!r}"
    if shard.sizes != manifest.splits[domain]:
        return f"split sizes {shard.sizes} but manifest says {manifest.splits[domain]}"
    if shard.classes != list(manifest.classes):
        return "classes differ from the manifest's"
    if shard.task != manifest.task:
        return f"its task is {shard.task} but the manifest says {manifest.task}"
    if shard.image_size != tuple(manifest.image_size) or shard.channels != manifest.channels:
        return (f"images are {shard.image_size[0]}x{shard.image_size[1]}x{shard.channels} but manifest says "
                f"{manifest.image_size[0]}x{manifest.image_size[1]}x{manifest.channels}")
    return None


def open_shard(root, manifest: DatasetManifest, domain: str) -> Shard:
    """Open ``domain``'s shard after checking it agrees with ``manifest`` and is the shard the manifest was
    written with.

    Cheap checks only (file length, its own dataset and domain name, split sizes, classes, image shape, and its
    content checksum, one attribute, against the manifest's); the file's sha256 is left to :func:`verify`, but for
    a manifest that records no content checksum (prepared by an older mpifl): then the file is read in full, once
    per process.
    """
    path = manifest.shard_path(root, domain)
    fix = remedy(root, manifest.name)
    if not path.is_file():
        raise MpiflError(f"shard missing: {path}; {fix}")
    entry = manifest.shards[domain]
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise MpiflError(f"shard {path} has {size} bytes but the manifest says "
                         f"{entry['bytes']}; it was changed after prepare; {fix}")
    shard = Shard(path, fix)
    problem = _disagreement(manifest, domain, shard) or _another_build(path, entry, shard)
    if problem:
        shard.close()
        raise MpiflError(f"shard {path} (domain {domain}): {problem}; {fix}")
    return shard


def _another_build(path: Path, entry: dict, shard: Shard) -> str | None:
    """Why ``shard`` is not the file the manifest ``entry`` was written with, or None."""
    if "content" in entry:
        if shard.content == entry["content"]:
            return None
        found = f"content sha256 {shard.content[:12]}..." if shard.content else "no content checksum"
        return (f"it is not the shard this manifest was prepared with ({found}, the manifest's "
                f"{entry['content'][:12]}...): another build's file copied over it")
    if _file_sha256(path) != entry["sha256"]:
        return "its sha256 differs from the manifest's: another build's file copied over it, or changed after prepare"
    return None


_HASHED: dict[tuple, str] = {}  # (path, device, inode, size, mtime) -> sha256: each file read once per process


def _file_sha256(path: Path) -> str:
    status = path.stat()
    key = (str(path), status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = sha256_file(path)
    return _HASHED[key]


def verify(root, name: str) -> list[str]:
    """Check every shard of dataset ``name`` against its manifest; return the problems.

    Per domain: the file exists, its length and sha256 match, it opens as a
    valid shard, agrees with the manifest, and its labels are in range.
    Shard files in the directory that the manifest does not list are reported
    too.  An empty list means the dataset is intact.
    """
    manifest = DatasetManifest.load(root, name)
    problems = []
    for domain in manifest.domains:
        path = manifest.shard_path(root, domain)
        entry = manifest.shards[domain]
        if not path.is_file():
            problems.append(f"{domain}: shard missing: {path}")
            continue
        if path.stat().st_size != entry["bytes"]:
            problems.append(f"{domain}: size {path.stat().st_size} bytes, manifest says {entry['bytes']}")
        if sha256_file(path) != entry["sha256"]:
            problems.append(f"{domain}: sha256 mismatch for {path}")
        try:
            with Shard(path, remedy(root, name)) as shard:
                problem = _disagreement(manifest, domain, shard)
                if problem:
                    problems.append(f"{domain}: {problem}")
                for split in SPLITS:
                    shard.labels(split)  # raises on labels out of range
        except (MpiflError, OSError) as e:
            problems.append(f"{domain}: {e}")
    listed = {entry["file"] for entry in manifest.shards.values()}
    for path in sorted((Path(root) / name).glob("*.h5")):
        if path.name not in listed:
            problems.append(f"{path.name}: shard not listed in the manifest")
    return problems
