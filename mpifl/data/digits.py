"""Digits-Five: ``python -m mpifl.data prepare digits --src DIR [--size S] [--data-root ROOT]``.

Five domains of the digits 0-9 (class ``"0"`` .. ``"9"``, label = digit),
converted from their usual downloads.  ``--src`` holds one folder per
domain, or a domain's files themselves (``--src/usps.h5``,
``--src/train_32x32.mat`` as torchvision stores SVHN, ...); a domain's files
are looked up in its folder, in that folder's ``raw/`` sub-folder
(torchvision's ``MNIST/raw``) and in a sub-folder named like the domain
(``mnist_m/mnist_m/`` of an unpacked tarball).  Folder and file names are
matched as :func:`mpifl.data.names.folder_key` says (any case, ``-``, ``_``,
blanks and, in file names, ``.`` between words do not count:
``train-images.idx3-ubyte`` is ``train-images-idx3-ubyte``); each mapping is
printed once.  Any subset of the five may be present: the converter prints
the domains found and missing on stderr and fails only when none is there.
A domain given both as a folder and as files in ``--src`` is an error, so is
a visible folder that is no domain (hidden and ``__`` folders are ignored,
other loose files too).

=========  =========================  ==============================================================
domain id  folder names               files
=========  =========================  ==============================================================
mnist      ``mnist``                  ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` (the IDX
                                      files of LeCun's site)
svhn       ``svhn``                   ``train_32x32.mat``, ``test_32x32.mat`` (cropped digits; ``X``
                                      32x32x3xN, ``y`` N x 1, label 10 means digit 0);
                                      ``extra_32x32.mat`` is ignored
usps       ``usps``                   ``usps.h5`` (groups ``train``/``test``, each ``data`` N x 256
                                      floats in [0, 1] (16x16 row-major) and ``target``)
synth      ``synth``, ``synthdigits``,  ``synth_train_32x32.mat``, ``synth_test_32x32.mat`` (Ganin &
           ``synth_digits``, ``syn``  Lempitsky's SynDigits in SVHN's format: ``X`` 32x32x3xN, ``y``;
                                      a label 10 also means 0)
mnistm     ``mnistm``, ``mnist_m``,   ``mnist_m_train/*.png``, ``mnist_m_test/*.png`` and
           ``mnist-m``                ``mnist_m_{train,test}_labels.txt`` (lines ``<file> <label>``),
                                      as in Ganin's ``mnist_m.tar.gz``
=========  =========================  ==============================================================

**FedBN's preprocessed copy** is also accepted, per domain folder (FedBN
names them ``MNIST``, ``SVHN``, ``USPS``, ``SynthDigits``, ``MNIST_M``):
``partitions/train_part<k>.pkl`` and ``test.pkl``, each a pickle of
``(images, labels)`` with images uint8 N x H x W or N x H x W x 3.  **Pickle is
read only for this source format**, and only numpy arrays are admitted: a
pickle can name any Python callable and run it while it loads, so the
unpickler resolves only the few numpy globals an array needs (its
``_reconstruct``/``_frombuffer``/``scalar``, ``ndarray``, ``dtype``, under
numpy 1.x's ``numpy.core`` or 2.x's ``numpy._core`` names) and refuses any
other before it is imported or called.  Every other source is read as plain
arrays.  Then train is the concatenation of the partitions (in ``k`` order)
and test is ``test.pkl``.
All present domains must use the same kind of source.

Protocol (FedBN, Li et al. ICLR 2021, as its public code prepares Digits-Five):

* images to ``S x S x 3`` (default 28): Pillow bilinear (antialiased, as
  torchvision's ``Resize([28, 28])`` in FedBN), grayscale replicated;
  28x28 sources (MNIST, MNIST-M) are not resampled at 28;
* raw sources: train and test merged, then a seeded stratified 80/20
  train/test split per class (as FedBN's preprocessing); val is a seeded
  stratified 10 % of that train part (an mpifl choice; FedBN has none);
  rows are sorted by class, then by position in the merged source (train
  file first, then test);
* FedBN's copy: its split, val = seeded stratified 10 % of its train rows
  (kept in their order);
* FedBN trains on ``--percent`` of its 10 partitions of about 743 images per
  domain; that subsampling is a run-time choice, the shards hold the full
  split and the manifest records ``fedbn_partition_size: 743``.
"""

from __future__ import annotations

import gzip
import re
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from mpifl.errors import MpiflError
from mpifl.data.arrays import (RESIZE_NOTE, ArrayDomain, carve_val, check_labels, check_size, load_array_pickle,
                               convert_arrays, seeded_split, split_rule, to_rgb, visible_dirs)
from mpifl.data.images import load_image, workers
from mpifl.data.manifest import DatasetManifest
from mpifl.data.names import MATCHING, Aliases, folder_key
from mpifl.data.splits import SPLIT_SEED
from mpifl.data.staging import source_dir

NAME = "digits"
CLASSES = [str(d) for d in range(10)]
DEFAULT_SIZE = 28
DOMAINS = ("mnist", "svhn", "usps", "synth", "mnistm")
#: Domain folder names besides the domain id (matched by folder_key: 'MNIST_M' is mnistm).
ALIASES = Aliases({"mnist": (), "svhn": (), "usps": (), "synth": ("synthdigits", "syn"), "mnistm": ()})
FRACTIONS = (0.8, 0.2)
VAL_FRACTION = 0.1
FEDBN_PARTITION_SIZE = 743
_TITLE = "Digits-Five (MNIST, SVHN, USPS, SynthDigits, MNIST-M)"
_READ_BYTES = 1 << 22  # read_idx reads its data in pieces of this size


# ---------------------------------------------------------------- readers


def read_idx(path: Path) -> np.ndarray:
    """An IDX file of unsigned bytes (gzipped when named ``*.gz``) as a uint8 array.  The header's counts are
    checked against the file's size before the data are read (for a gzip file, the inflated size its trailer
    records), and the data are read in bounded pieces, so that memory stays within what the header announces
    whatever the file inflates to (a gzip bomb)."""
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as f:
            head = f.read(4)
            if len(head) < 4 or head[:3] != b"\0\0\x08":
                raise MpiflError(f"{path} is not an IDX file of unsigned bytes; download the file again")
            shape = f.read(4 * head[3])
            if len(shape) < 4 * head[3]:
                raise MpiflError(f"{path} is not an IDX file of unsigned bytes; download the file again")
            dims = struct.unpack(f">{head[3]}I", shape)
            expected = 4 + len(shape) + int(np.prod(dims, dtype=object))
            if not _may_hold(path, expected):
                why = "its gzip trailer and size say otherwise" if path.suffix == ".gz" else "the file has another size"
                raise MpiflError(f"{path} is not the {expected} bytes its header {dims} says ({why}): it is cut short "
                                 "or not the published file; download the file again")
            pixels = np.empty(expected - 4 - len(shape), np.uint8)
            view, done = memoryview(pixels), 0
            while done < len(view):
                got = f.readinto(view[done:done + _READ_BYTES])
                if not got:
                    break
                done += got
            if done < len(view) or f.read(1):
                raise MpiflError(f"{path} holds {'less' if done < len(view) else 'more'} data than its header {dims} "
                                 "says: it is cut short or not the published file; download the file again")
    except (OSError, EOFError, zlib.error) as e:
        raise MpiflError(f"cannot read {path} ({e}); download the file again") from None
    return pixels.reshape(dims)


def _may_hold(path: Path, nbytes: int) -> bool:
    """Whether ``path`` can hold ``nbytes`` of data, found without inflating anything: a plain file has that size;
    a gzip file records it in its trailer (modulo 2**32) and cannot inflate beyond deflate's ratio of 1032."""
    size = path.stat().st_size
    if path.suffix != ".gz":
        return size == nbytes
    with path.open("rb") as f:
        f.seek(max(size - 4, 0))
        trailer = f.read(4)
    return len(trailer) == 4 and struct.unpack("<I", trailer)[0] == nbytes % (1 << 32) and nbytes <= 1032 * size


def _loadmat(path: Path) -> dict:
    import scipy.io  # only the .mat sources need scipy

    try:
        return scipy.io.loadmat(str(path))
    except NotImplementedError:
        raise MpiflError(f"{path} is a MATLAB v7.3 (HDF5) file, which is not supported; use the v5 "
                         "original") from None
    except (OSError, ValueError, TypeError, EOFError) as e:
        raise MpiflError(f"cannot read {path} ({type(e).__name__}: {e}); download the file again") from None


def read_svhn_mat(path: Path, size: int) -> tuple[np.ndarray, np.ndarray]:
    """SVHN-format ``.mat``: ``X`` 32x32x3xN, ``y`` N (10 means 0)."""
    mat = _loadmat(path)
    if "X" not in mat or "y" not in mat:
        raise MpiflError(f"{path} has no X and y arrays (has {', '.join(k for k in mat if not k.startswith('__'))}"
                         "); use the cropped-digits (32x32) file")
    x = np.asarray(mat["X"])
    if x.ndim != 4 or x.shape[2] != 3:
        raise MpiflError(f"{path}: X has shape {x.shape}, expected 32x32x3xN; use the cropped-digits file")
    images = np.moveaxis(x, 3, 0)
    labels = np.asarray(mat["y"]).reshape(-1)
    labels = np.where(labels == 10, 0, labels)
    labels = check_labels(labels, len(images), 10, str(path))
    return to_rgb(images, size, str(path)), labels


def file_key(name: str) -> str:
    """A file name as matched: :func:`~mpifl.data.names.folder_key` with ``.`` a separator too."""
    return folder_key(name.replace(".", " "))


def _lookup(places: list[Path], names, directory: bool = False) -> Path | None:
    """The first file (or folder) in ``places`` whose name matches one of ``names`` by :func:`file_key`."""
    wanted = {file_key(n) for n in names}
    for place in places:
        for entry in sorted(place.iterdir()):
            if file_key(entry.name) in wanted and (entry.is_dir() if directory else entry.is_file()):
                return entry
    return None


def _find(places: list[Path], names, where: str, directory: bool = False) -> Path:
    found = _lookup(places, names, directory)
    if found is None:
        raise MpiflError(f"{where}: {names[0]} is missing in {places[0]}; put the complete download there or "
                         "remove the domain's folder or files")
    return found


def _mnist_names(split: str, kind: str) -> tuple[str, str]:
    prefix, tag = {"train": "train", "test": "t10k"}[split], {"images": "idx3", "labels": "idx1"}[kind]
    return f"{prefix}-{kind}-{tag}-ubyte.gz", f"{prefix}-{kind}-{tag}-ubyte"


def _mnist_files(places: list[Path]) -> dict:
    return {(split, kind): _find(places, _mnist_names(split, kind), "mnist")
            for split in ("train", "test") for kind in ("images", "labels")}


def _load_mnist(files: dict, size: int):
    parts = []
    for split in ("train", "test"):
        images, labels = read_idx(files[split, "images"]), read_idx(files[split, "labels"])
        if images.ndim != 3:
            raise MpiflError(f"{files[split, 'images']} holds shape {images.shape}, expected N x 28 x 28; "
                             "use the images file")
        labels = check_labels(labels, len(images), 10, f"{files[split, 'labels']}")
        parts.append((to_rgb(images, size, str(files[split, "images"])), labels))
    return parts


def _load_usps(path: Path, size: int):
    import h5py

    parts = []
    try:
        with h5py.File(path, "r") as f:
            for split in ("train", "test"):
                if split not in f or "data" not in f[split] or "target" not in f[split]:
                    raise MpiflError(f"{path} has no {split}/data and {split}/target; use the usps.h5 of "
                                     "the USPS download")
                data = np.asarray(f[split]["data"][...], np.float64)
                target = f[split]["target"][...]
                if data.ndim != 2 or data.shape[1] != 256:
                    raise MpiflError(f"{path}: {split}/data has shape {data.shape}, expected N x 256; use "
                                     "the usps.h5 of the USPS download")
                images = np.clip(np.round(data * 255.0), 0, 255).astype(np.uint8).reshape(-1, 16, 16)
                labels = check_labels(target, len(images), 10, f"{path} {split}")
                parts.append((to_rgb(images, size, str(path)), labels))
    except OSError as e:
        raise MpiflError(f"cannot read {path} ({e}); download usps.h5 again") from None
    return parts


def _mnistm_lists(places: list[Path]) -> dict:
    lists = {}
    for split in ("train", "test"):
        images = _lookup(places, (f"mnist_m_{split}",), directory=True)
        labels = _lookup(places, (f"mnist_m_{split}_labels.txt",))
        for path, name in ((images, f"mnist_m_{split}"), (labels, f"mnist_m_{split}_labels.txt")):
            if path is None:
                raise MpiflError(f"mnistm: {name} is missing in {places[0]}; unpack the complete "
                                 "mnist_m.tar.gz there or remove the domain's folder or files")
        lists[split] = (images, labels)
    return lists


def _load_mnistm(lists: dict, size: int):
    parts = []
    for split in ("train", "test"):
        images_dir, labels_txt = lists[split]
        rows = []
        try:
            lines = labels_txt.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise MpiflError(f"cannot read {labels_txt} ({e}); unpack mnist_m.tar.gz again") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            pieces = line.split()
            try:
                file, label = pieces[0], int(pieces[1])
                if len(pieces) != 2:
                    raise ValueError
            except (IndexError, ValueError):
                raise MpiflError(f"{labels_txt} line {number} is not '<file> <label>': {line.strip()!r}; "
                                 "unpack mnist_m.tar.gz again") from None
            if not 0 <= label <= 9:
                raise MpiflError(f"{labels_txt} line {number}: label {label} is not a digit 0..9; unpack "
                                 "mnist_m.tar.gz again")
            path = images_dir / file
            if not path.is_file():
                raise MpiflError(f"{labels_txt} line {number} names {file}, which is not in {images_dir}; "
                                 "unpack mnist_m.tar.gz again")
            rows.append((path, label))
        if not rows:
            raise MpiflError(f"{labels_txt} lists no images; unpack mnist_m.tar.gz again")
        with ThreadPoolExecutor(max_workers=workers()) as pool:
            images = np.stack(list(pool.map(lambda p: load_image(p, size), [p for p, _ in rows])))
        parts.append((images, np.array([label for _, label in rows], np.int64)))
    return parts


def _fedbn_files(folder: Path, domain: str) -> tuple[list[Path], Path]:
    parts_dir = folder / "partitions"
    parts = []
    if parts_dir.is_dir():
        for p in parts_dir.iterdir():
            m = re.fullmatch(r"train_part(\d+)\.pkl", p.name)
            if m and p.is_file():
                parts.append((int(m.group(1)), p))
    test = folder / "test.pkl"
    if not parts:
        raise MpiflError(f"{domain}: no partitions/train_part<k>.pkl in {folder}; copy FedBN's complete "
                         "domain folder (partitions/ and test.pkl)")
    if not test.is_file():
        raise MpiflError(f"{domain}: test.pkl is missing in {folder}; copy FedBN's complete domain folder")
    return [p for _, p in sorted(parts)], test


def _read_pickle(path: Path, size: int):
    """FedBN's ``(images, labels)`` pickle (the only pickle this converter reads), numpy arrays only
    (:func:`~mpifl.data.arrays.load_array_pickle`)."""
    try:
        with open(path, "rb") as f:
            data = load_array_pickle(f, path, "FedBN's numpy arrays",
                                     "re-download FedBN's Digits-Five from its official repository, or convert "
                                     "the raw downloads instead (see `pydoc mpifl.data.digits`)")
    except MpiflError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise MpiflError(f"cannot unpickle {path} ({type(e).__name__}: {e}); copy FedBN's file again") from None
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise MpiflError(f"{path} does not hold (images, labels); copy FedBN's file again")
    images = np.asarray(data[0])
    if images.ndim not in (3, 4):
        raise MpiflError(f"{path} holds images of shape {images.shape}; copy FedBN's file again")
    labels = check_labels(data[1], len(images), 10, str(path))
    return to_rgb(images, size, str(path)), labels


# ---------------------------------------------------------------- scanning


#: The file that shows a domain's download lies loose in --src.
_MARKERS = {"mnist": _mnist_names("train", "images"), "svhn": ("train_32x32.mat",), "usps": ("usps.h5",),
            "synth": ("synth_train_32x32.mat",), "mnistm": ("mnist_m_train_labels.txt",)}
#: Folders that belong to a loose domain download in --src (not domain folders).
_LOOSE_FOLDERS = {"mnistm": ("mnist_m_train", "mnist_m_test")}


class _Source:
    """Where one domain's download is: its folder (None for files loose in --src) and the places searched."""

    def __init__(self, domain: str, src: Path, folder: Path | None):
        self.domain, self.folder = domain, folder
        if folder is None:
            self.places, self.shown = [src], f"files in {src.resolve()}"
        else:
            subfolders = [p for p in visible_dirs(folder)
                          if folder_key(p.name) == "raw" or ALIASES.resolve(p.name) == domain]
            self.places, self.shown = [folder, *subfolders], f"domain folder '{folder.name}' of {src.resolve()}"


def _sources(src: Path, mapped: dict) -> dict[str, _Source]:
    """The domains present in ``src``, as folders or loose files; unknown folders are errors."""
    loose = {d for d, names in _MARKERS.items() if _lookup([src], names) is not None}
    loose_folders = {file_key(n) for d in loose for n in _LOOSE_FOLDERS.get(d, ())}
    found: dict[str, _Source] = {}
    for folder in visible_dirs(src):
        domain = ALIASES.resolve(folder.name)
        if domain is None:
            if file_key(folder.name) in loose_folders:
                continue
            raise MpiflError(f"unknown domain folder '{folder.name}' in {src}; digits accepts folders "
                             f"{ALIASES.accepted()} ({MATCHING}) or their files in --src (see "
                             "mpifl.data.digits): rename or move it away")
        if domain in found:
            raise MpiflError(f"two folders for domain {domain} in {src}: '{found[domain].folder.name}' and "
                             f"'{folder.name}'; keep one")
        if domain in loose:
            raise MpiflError(f"domain {domain} is both folder '{folder.name}' and "
                             f"{_lookup([src], _MARKERS[domain]).name} in {src}; keep one")
        found[domain] = _Source(domain, src, folder)
        if folder.name != domain:
            mapped[f"domain folder '{folder.name}' -> {domain}"] = None
    for domain in (d for d in DOMAINS if d in loose):
        found[domain] = _Source(domain, src, None)
        mapped[f"{domain} from {_lookup([src], _MARKERS[domain]).name} in --src"] = None
    return {d: found[d] for d in DOMAINS if d in found}


def _is_fedbn(source: _Source) -> bool:
    folder = source.folder
    return folder is not None and ((folder / "partitions").is_dir() or (folder / "test.pkl").is_file())


def _plan(source: _Source, size: int) -> tuple[str, Callable]:
    """(description, loader) for one domain; every file is located here, before any is read."""
    domain, places = source.domain, source.places
    if _is_fedbn(source):
        parts, test = _fedbn_files(source.folder, domain)
        return (f"FedBN preprocessed partitions ({len(parts)} train parts + test.pkl)",
                lambda: ([_read_pickle(p, size) for p in parts], _read_pickle(test, size)))
    if domain == "mnist":
        files = _mnist_files(places)
        return "MNIST IDX files", lambda: _load_mnist(files, size)
    if domain in ("svhn", "synth"):
        prefix = "" if domain == "svhn" else "synth_"
        mats = [_find(places, (f"{prefix}{s}_32x32.mat",), domain) for s in ("train", "test")]
        return (f"{mats[0].name} + {mats[1].name}",
                lambda: [read_svhn_mat(m, size) for m in mats])
    if domain == "usps":
        path = _find(places, ("usps.h5",), domain)
        return path.name, lambda: _load_usps(path, size)
    lists = _mnistm_lists(places)
    return "MNIST-M PNGs + label lists", lambda: _load_mnistm(lists, size)


def _raw_splits(domain: str, load: Callable) -> dict:
    """Merge train+test, seeded stratified 80/20, val 10 % of train."""
    parts = load()
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    train, test = seeded_split(labels, FRACTIONS, (NAME, domain))
    train, val = carve_val(train, labels, VAL_FRACTION, (NAME, domain))
    return {s: (images[i], labels[i]) for s, i in (("train", train), ("val", val), ("test", test))}


def _fedbn_splits(domain: str, load: Callable) -> dict:
    train_parts, test = load()
    images = np.concatenate([p[0] for p in train_parts])
    labels = np.concatenate([p[1] for p in train_parts])
    order = np.arange(len(labels))
    train, val = carve_val(order, labels, VAL_FRACTION, (NAME, domain))
    train, val = np.sort(train), np.sort(val)
    return {"train": (images[train], labels[train]), "val": (images[val], labels[val]), "test": test}


def prepare_digits(src, out, size: int | None = None,
                   log: Callable[[str], None] | None = None) -> DatasetManifest:
    """Convert the Digits-Five downloads in ``src`` into ``<out>/digits``; return the manifest."""
    log = log or (lambda line: None)
    src = source_dir(NAME, src, f"the domain folders {', '.join(DOMAINS)} (see `pydoc mpifl.data.digits`)")
    out = Path(out)
    size = check_size(size, DEFAULT_SIZE)
    mapped: dict = {}
    folders = _sources(src, mapped)
    if not folders:
        raise MpiflError(f"no digits domain folder or file in {src}; expected one or more of "
                         f"{', '.join(DOMAINS)} (see `pydoc mpifl.data.digits`)")
    missing = [d for d in DOMAINS if d not in folders]
    log(f"digits: found {', '.join(folders)}; missing {', '.join(missing) or 'none'}")
    for line in mapped:
        log(f"digits: {line}")
    kinds = {d: _is_fedbn(f) for d, f in folders.items()}
    if len(set(kinds.values())) > 1:
        fedbn = [d for d, k in kinds.items() if k]
        raw = [d for d, k in kinds.items() if not k]
        raise MpiflError(f"domains {', '.join(fedbn)} are FedBN pickles but {', '.join(raw)} are raw "
                         "downloads; convert all domains from the same kind of source")
    fedbn = next(iter(kinds.values()))
    plans = {d: _plan(f, size) for d, f in folders.items()}
    if fedbn:
        rule = (f"FedBN's split (train = its partitions, test = test.pkl); val = seeded stratified "
                f"{100 * VAL_FRACTION:g} % of train (seed {SPLIT_SEED})")
        origin = "FedBN's preprocessed Digits-Five; val is an mpifl choice"
        splitter = _fedbn_splits
    else:
        rule = "train+test merged; " + split_rule(FRACTIONS, VAL_FRACTION)
        origin = ("FedBN (Li et al., ICLR 2021): train+test merged, stratified 80/20; val 10 % of train "
                  "is an mpifl choice")
        splitter = _raw_splits
    domains = [ArrayDomain(d, f"{_TITLE}: {folders[d].shown}, {plans[d][0]}; {rule}",
                           (lambda d=d: splitter(d, plans[d][1])))
               for d in folders]
    protocol = {"clients_per_domain": 1, "split": rule, "split_origin": origin,
                "default_size": DEFAULT_SIZE, "size_origin": "FedBN: 28x28x3",
                "resize": RESIZE_NOTE, "fedbn_partition_size": FEDBN_PARTITION_SIZE,
                "note": ("FedBN trains each client on --percent of 10 partitions of ~743 train images; "
                         "that subsampling is a run-time choice, the shards hold the full split"),
                "domains_missing": missing}
    return convert_arrays(NAME, src, out, domains, CLASSES, size, _TITLE, protocol, log)
