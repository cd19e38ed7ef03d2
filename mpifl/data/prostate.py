"""Multi-site prostate MRI: ``python -m mpifl.data prepare prostate --src DIR [--size S] [--data-root ROOT]``.

Source: the six-site T2-weighted prostate MRI release of SAML (Liu, Dou and Heng, "Shape-aware
meta-learning for generalizing prostate MRI segmentation to unseen domains", MICCAI 2020;
https://liuquande.github.io/SAML/), which HarmoFL, FedFA and FedRDN train on: RUNMC and BMC from
NCI-ISBI 2013, I2CVB, and UCL, BIDMC and HK from PROMISE12, every case a NIfTI volume with its
segmentation, one folder per site::

    BIDMC/Case00.nii.gz  BIDMC/Case00_segmentation.nii.gz  ...
    HK/  I2CVB/  ISBI/ (= RUNMC)  ISBI_1.5/ (= BMC, its masks named Case00_Segmentation.nii.gz)  UCL/

``--src`` holds the six site folders, or holds the one folder that does (e.g. ``Processed_data_nii/``).
Accepted: site folders in any case, with or without ``_``/``-``/blanks, ``ISBI`` for RUNMC and
``ISBI_1.5`` for BMC (FedFA's and FedRDN's names are BIDMC, HK, I2CVB, BMC, RUNMC, UCL: the domain
ids); volumes ``<case>.nii.gz`` or ``<case>.nii``, masks ``<case>`` + ``_segmentation``,
``_Segmentation`` or ``_seg`` (any case) + ``.nii.gz`` or ``.nii``.  Other files are ignored; a
volume without its mask, a mask without its volume, two files for one case, a volume and mask of
different shapes, a file nibabel cannot read or a volume that is not 3-D is an error naming the file.

**Preprocessing**, as FedFA's public code (Zhou and Konukoglu, ICLR 2023; ``Prostate`` in
``pyfed/dataset/dataset.py`` of github.com/tfzhou/FedFA), whose slices and intensities are HarmoFL's
(Jiang, Wang and Dou, AAAI 2022; ``utils/dataset.py`` of github.com/med-air/HarmoFL, which splits
64/16/20) and whose split gives exactly the slice counts of FedRDN's Table 6 (BIDMC 156/52/52 ...
UCL 105/35/35; FedRDN's public code has no segmentation):

* intensities per volume: clipped at the volume's 99th percentile (NumPy's linear quantile), scaled
  from the volume's minimum to that percentile onto 0..255 and truncated to uint8;
* masks: every label >= 1 is prostate (1; sites labelling zones get them merged), the rest background;
  a mask whose values are not integer labels (a soft or resampled one) is refused, naming its file;
* slices: the axial slices (along the volume's third NIfTI axis; a slice's rows run along the second
  axis, as in the SimpleITK arrays the reference reads) whose mask holds prostate, the first and last
  slice of a volume excepted (the reference stacks each slice with its two neighbours);
* split per site and per slice (a case's slices fall into several splits, as in the reference): the
  slices, in case-name then slice order, are permuted with a generator seeded from
  :data:`~mpifl.data.splits.SPLIT_SEED` and the site id (the reference draws its permutation once
  and saves it per site; HarmoFL ships those files, FedFA's are not public), then train = the first
  ``int(0.6 n)``, val = the next ``int(0.2 n)``, test = the last ``int(0.2 n)``: the 0 to 2 slices
  between val and test are left out, as the reference does; a site with a split left empty is refused
  (under five slices with prostate).  FedFA's minimum of 32 train slices is
  not kept (on a small site it makes train overlap test; every real site has over 150 slices).

**Channels**: each slice with its two neighbours as 3 channels (the slice in the middle), the reference's
input; :data:`STACK_NEIGHBOURS` ``False`` writes the slice alone.  Where mpifl chooses: **size**: 384 px
by default, the
release's in-plane size (the reference does not resize); a slice of another size is resized once,
the image with Pillow's bilinear filter (antialiased) after the uint8 scaling, the mask with nearest
neighbour (it stays binary).  Volumes are read with nibabel (its scaling applied), one at a time.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from mpifl.errors import MpiflError
from mpifl.data.arrays import check_size, visible_dirs
from mpifl.data.links import check_link
from mpifl.data.manifest import DatasetManifest, build_manifest
from mpifl.data.names import Aliases
from mpifl.data.shard import SPLITS, ShardWriter
from mpifl.data.splits import SPLIT_SEED
from mpifl.data.staging import source_dir, staged_dataset

NAME = "prostate"
#: The sites in FedRDN's Table 2 order; the domain ids (shard names).
SITES = ("BIDMC", "HK", "I2CVB", "BMC", "RUNMC", "UCL")
CLASSES = ["background", "prostate"]
DEFAULT_SIZE = 384
FRACTIONS = (0.6, 0.2, 0.2)
#: True: each slice with its two neighbours as 3 channels, the reference's input; False: the slice alone.
STACK_NEIGHBOURS = True
SITE_FOLDERS = Aliases({"BIDMC": (), "HK": (), "I2CVB": (), "BMC": ("ISBI_1.5",), "RUNMC": ("ISBI",), "UCL": ()})
MASK_SUFFIXES = ("_segmentation", "_seg")
EXTENSIONS = (".nii.gz", ".nii")
_SOURCE = ("multi-site prostate MRI of SAML (Liu, Dou and Heng, MICCAI 2020): RUNMC and BMC (NCI-ISBI 2013), I2CVB, "
           "UCL, BIDMC and HK (PROMISE12), preprocessed as FedFA's public code (Zhou and Konukoglu, ICLR 2023)")
_RELEASE = "download the release again from https://liuquande.github.io/SAML/"
_BILINEAR = getattr(Image, "Resampling", Image).BILINEAR
_NEAREST = getattr(Image, "Resampling", Image).NEAREST


@dataclass(frozen=True)
class Case:
    """One case of a site: its name and the paths of its volume and mask."""

    name: str
    volume: Path
    mask: Path


def _channels() -> int:
    return 3 if STACK_NEIGHBOURS else 1


def find_sites(src: Path) -> dict[str, Path]:
    """Site id -> its folder, in ``src`` or in the one folder below it that holds site folders."""
    found = _site_folders(src)
    if not found:
        below = {d: f for d in visible_dirs(src) if (f := _site_folders(d))}
        if len(below) > 1:
            raise MpiflError(f"several folders in {src} hold prostate site folders ({', '.join(d.name for d in below)}); "
                             "point --src at the one to convert")
        src, found = next(iter(below.items()), (src, {}))
    missing = [s for s in SITES if s not in found]
    if missing:
        have = f"found {', '.join(f'{p.name} ({s})' for s, p in found.items())}" if found else "found none"
        raise MpiflError(f"no folder for site {', '.join(missing)} in {src} ({have}); the release has one folder per "
                         f"site: {SITE_FOLDERS.accepted()}")
    return {s: found[s] for s in SITES}


def _site_folders(folder: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in visible_dirs(folder):
        site = SITE_FOLDERS.resolve(path.name)
        if site is None:
            continue
        if site in found:
            raise MpiflError(f"folders {found[site].name} and {path.name} in {folder} both name site {site}; "
                             "keep one")
        found[site] = path
    return found


def _nifti(name: str) -> tuple[str, bool] | None:
    """``(case name, is a mask)`` of a NIfTI file name, None for other files."""
    ext = next((e for e in EXTENSIONS if name.casefold().endswith(e)), None)
    if ext is None or name.startswith("."):
        return None
    stem = name[:-len(ext)]
    suffix = next((s for s in MASK_SUFFIXES if stem.casefold().endswith(s)), None)
    return (stem[:-len(suffix)], True) if suffix else (stem, False)


def scan_site(site: str, folder: Path) -> list[Case]:
    """The cases in ``folder`` in name order, every volume paired with its mask."""
    files: dict[bool, dict[str, tuple[str, Path]]] = {False: {}, True: {}}
    for path in sorted(folder.iterdir()):
        kind = _nifti(path.name)
        if kind is None:
            continue
        check_link(path, "NIfTI file")
        if not path.is_file():
            continue
        case, is_mask = kind
        _, other = files[is_mask].setdefault(case.casefold(), (case, path))
        if other != path:
            raise MpiflError(f"two {'masks' if is_mask else 'volumes'} of one case in {folder}: {other.name} and "
                             f"{path.name}; keep one")
    volumes, masks = files[False], files[True]
    if not volumes and not masks:
        raise MpiflError(f"no NIfTI volume (.nii.gz, .nii) in {folder} (site {site}); copy the site's cases there "
                         f"from the release")
    for key, (case, path) in masks.items():
        if key not in volumes:
            raise MpiflError(f"mask {path} has no volume {case}.nii.gz next to it; restore the volume or remove the mask "
                             f"({_RELEASE})")
    for key, (case, path) in volumes.items():
        if key not in masks:
            raise MpiflError(f"volume {path} has no mask ({case}_segmentation.nii.gz, _Segmentation or _seg) next to "
                             f"it; restore the mask or remove the volume ({_RELEASE})")
    return [Case(case, path, masks[key][1]) for key, (case, path) in sorted(volumes.items())]


def read_nifti(path: Path) -> np.ndarray:
    """The 3-D array of a NIfTI file (trailing axes of length 1 dropped), axes as stored (x, y, z)."""
    try:
        import nibabel
    except ImportError:
        raise MpiflError("reading the prostate NIfTI volumes needs nibabel: pip install nibabel") from None
    try:
        data = np.asanyarray(nibabel.load(path).dataobj)
    except (OSError, EOFError, ValueError, zlib.error, nibabel.filebasedimages.ImageFileError) as e:
        raise MpiflError(f"cannot read {path} ({type(e).__name__}: {e}); {_RELEASE}") from None
    while data.ndim > 3 and data.shape[-1] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise MpiflError(f"{path} holds an array of shape {data.shape}, expected one 3-D volume; {_RELEASE}")
    return data


def to_uint8(volume: np.ndarray, path: Path) -> np.ndarray:
    """The reference's windowing: clip at the 99th percentile, scale min..percentile onto 0..255, truncate."""
    volume = volume.astype(np.float64)
    low, high = volume.min(), np.quantile(volume, 0.99)
    if not high > low:
        raise MpiflError(f"volume {path} has no intensity range (minimum {low:g}, 99th percentile {high:g}); "
                         f"{_RELEASE}")
    return ((np.minimum(volume, high) - low) / (high - low) * 255).astype(np.uint8)


def case_slices(case: Case, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The kept slices of a case: images uint8 (n, size, size, C) and binary masks uint8 (n, size, size)."""
    volume, mask = read_nifti(case.volume), read_nifti(case.mask)
    if volume.shape != mask.shape:
        raise MpiflError(f"volume {case.volume} is {'x'.join(map(str, volume.shape))} but its mask {case.mask.name} "
                         f"is {'x'.join(map(str, mask.shape))}; use the pair as released ({_RELEASE})")
    labels = np.asarray(mask)
    if labels.dtype.kind == "f" and not (np.isfinite(labels).all() and np.array_equal(labels, np.round(labels))):
        odd = labels[~(np.isfinite(labels) & (labels == np.round(labels)))]
        raise MpiflError(f"mask {case.mask} holds values that are not integer labels (e.g. {odd.flat[0]:g}: a soft "
                         f"or resampled mask); use the release's label masks ({_RELEASE})")
    pixels = to_uint8(volume, case.volume).T  # (z, y, x), as SimpleITK's arrays
    prostate = (labels >= 1).astype(np.uint8).T
    kept = [k for k in range(1, len(prostate) - 1) if prostate[k].any()]
    images = np.empty((len(kept), size, size, _channels()), np.uint8)
    masks = np.empty((len(kept), size, size), np.uint8)
    for i, k in enumerate(kept):
        stack = pixels[k - 1:k + 2] if STACK_NEIGHBOURS else pixels[k:k + 1]
        images[i] = np.stack([_resized(s, size, _BILINEAR) for s in stack], axis=-1)
        masks[i] = _resized(prostate[k], size, _NEAREST)
    return images, masks


def _resized(plane: np.ndarray, size: int, resample) -> np.ndarray:
    if plane.shape == (size, size):
        return plane
    return np.asarray(Image.fromarray(np.ascontiguousarray(plane)).resize((size, size), resample))


def split_slices(n: int, site: str) -> list[np.ndarray]:
    """Indices of the train, val and test slices among a site's ``n`` (each part sorted; the rest left out)."""
    order = np.random.default_rng([SPLIT_SEED, zlib.crc32(f"{NAME}/{site}".encode())]).permutation(n)
    train, val, test = (int(f * n) for f in FRACTIONS)
    return [np.sort(part) for part in (order[:train], order[train:train + val], order[n - test:])]


def _write_site(site: str, folder: Path, cases: list[Case], built: Path, size: int, rule: str, log) -> int:
    """Convert one site into ``built/<site>.h5``; return the number of slices written."""
    started = time.monotonic()
    parts = [case_slices(case, size) for case in cases]
    images = np.concatenate([p[0] for p in parts])
    masks = np.concatenate([p[1] for p in parts])
    if not len(images):
        raise MpiflError(f"no slice of site {site} ({folder}) has prostate in its mask (a volume's first and last "
                         f"slices not counted); the masks are empty or not the release's: {_RELEASE}")
    split = split_slices(len(images), site)
    empty = [name for name, rows in zip(SPLITS, split) if not len(rows)]
    if empty:
        raise MpiflError(f"site {site} ({folder}) has only {len(images)} slices with prostate, so its "
                         f"{' and '.join(empty)} split{'s' if len(empty) > 1 else ''} would be empty; restore the "
                         f"site's missing cases ({_RELEASE}) or leave the site out of --src")
    with ShardWriter(built / f"{site}.h5", dataset=NAME, domain=site, classes=CLASSES, image_size=(size, size),
                     channels=_channels(), source=f"{_SOURCE}: site {site} ({folder.resolve()}); {rule}",
                     task="segmentation") as writer:
        for name, rows in zip(SPLITS, split):
            writer.add(name, images[rows], masks[rows])
    written = sum(len(rows) for rows in split)
    log(f"{NAME}: {site} train/val/test {'/'.join(str(len(r)) for r in split)} of {len(images)} slices with prostate "
        f"({len(images) - written} left out) in {time.monotonic() - started:.1f} s")
    return written


def prepare_prostate(src, out, size: int | None = None,
                     log: Callable[[str], None] | None = None) -> DatasetManifest:
    """Convert the multi-site prostate MRI release in ``src`` into ``<out>/prostate``; return the manifest."""
    log = log or (lambda line: None)
    src, out = source_dir(NAME, src, "the prostate release's site folders (BIDMC, HK, ...)"), Path(out)
    size = check_size(size, DEFAULT_SIZE)
    started = time.monotonic()
    folders = find_sites(src)
    cases = {site: scan_site(site, folder) for site, folder in folders.items()}
    for site, folder in folders.items():
        suffixes = sorted({c.mask.name[len(c.name):] for c in cases[site]})
        log(f"{NAME}: {site} <- {folder} ({len(cases[site])} cases, masks *{', *'.join(suffixes)})")
    rule = (f"per site and slice: seeded permutation (seed {SPLIT_SEED}), train/val/test = int(60/20/20 % of the "
            "slices), the remainder left out")
    written = 0
    with staged_dataset(out, NAME, src) as built:
        for site, folder in folders.items():
            written += _write_site(site, folder, cases[site], built, size, rule, log)
        build_manifest(built.parent, NAME, source=f"{_SOURCE}; converted from {src.resolve()}",
                       protocol=_protocol(rule))
    log(f"{NAME}: converted {written} slices at {size}x{size} in {time.monotonic() - started:.1f} s")
    return DatasetManifest.load(out, NAME)


def _protocol(rule: str) -> dict:
    return {"clients_per_domain": 1, "split": rule,
            "split_origin": "FedFA's public code (its counts are FedRDN's Table 6); the permutation is mpifl's",
            "slices": "axial slices with prostate, first and last slice of a volume excepted",
            "intensity": "per volume: clip at the 99th percentile, min..percentile onto 0..255, truncated",
            "masks": "labels >= 1 are prostate (1), the rest background (0)",
            "channels": ("the slice with its two neighbours (the reference's input)" if STACK_NEIGHBOURS
                         else "the slice alone (the reference stacks its two neighbours as 3 channels)"),
            "default_size": DEFAULT_SIZE, "size_origin": "the release's in-plane size (the reference does not resize)",
            "resize": "once to SxS: images Pillow bilinear (antialiased) after uint8 scaling, masks nearest"}
