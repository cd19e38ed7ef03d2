"""Digits-Five converter: every source layout read back pixel- and label-exact, seeded splits, errors."""

from __future__ import annotations

import gzip
import os
import pickle
import re
import struct
import tracemalloc
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import scipy.io
from click.testing import CliRunner
from PIL import Image

from mpifl.data.__main__ import cli
from mpifl.data.digits import DOMAINS, _read_pickle, prepare_digits, read_idx
from mpifl.data.manifest import DatasetManifest, verify
from mpifl.data.shard import SPLITS, Shard
from mpifl.errors import MpiflError

_BILINEAR = getattr(Image, "Resampling", Image).BILINEAR
PER_CLASS = 6  # per class and source split


def _labels(n_per_class, seed):
    labels = np.repeat(np.arange(10), n_per_class)
    return np.random.default_rng(seed).permutation(labels)


def _idx(path: Path, array: np.ndarray, compress=True):
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def write_mnist(folder: Path, seed=1, compress=True):
    """IDX files of 28x28 digits; returns [(images N,28,28, labels)] for train, test."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for prefix, k in (("train", PER_CLASS), ("t10k", PER_CLASS // 2)):
        labels = _labels(k, seed + len(prefix))
        images = rng.integers(0, 256, (len(labels), 28, 28), dtype=np.uint8)
        suffix = ".gz" if compress else ""
        _idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", images, compress)
        _idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", labels, compress)
        parts.append((images, labels))
    return parts


def write_mat(folder: Path, prefix: str, seed=2):
    """SVHN-format .mat files (X 32x32x3xN, y N x 1 with 10 for 0); returns [(images NHWC, digits)]."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for split, k in (("train", PER_CLASS), ("test", PER_CLASS // 2)):
        digits = _labels(k, seed + len(split))
        images = rng.integers(0, 256, (len(digits), 32, 32, 3), dtype=np.uint8)
        y = np.where(digits == 0, 10, digits).reshape(-1, 1).astype(np.uint8)
        scipy.io.savemat(folder / f"{prefix}{split}_32x32.mat", {"X": np.moveaxis(images, 0, 3), "y": y})
        parts.append((images, digits))
    return parts


def write_usps(folder: Path, seed=3):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with h5py.File(folder / "usps.h5", "w") as f:
        for split, k in (("train", PER_CLASS), ("test", PER_CLASS // 2)):
            labels = _labels(k, seed + len(split))
            pixels = rng.integers(0, 256, (len(labels), 16, 16), dtype=np.uint8)
            f.create_group(split)
            f[split]["data"] = pixels.reshape(-1, 256).astype(np.float64) / 255.0
            f[split]["target"] = labels
            parts.append((pixels, labels))
    return parts


def write_mnistm(folder: Path, seed=4):
    rng = np.random.default_rng(seed)
    parts = []
    for split, k in (("train", PER_CLASS), ("test", PER_CLASS // 2)):
        labels = _labels(k, seed + len(split))
        images = rng.integers(0, 256, (len(labels), 28, 28, 3), dtype=np.uint8)
        directory = folder / f"mnist_m_{split}"
        directory.mkdir(parents=True, exist_ok=True)
        lines = []
        for i, (image, label) in enumerate(zip(images, labels)):
            Image.fromarray(image).save(directory / f"{i:08d}.png")
            lines.append(f"{i:08d}.png {label}")
        (folder / f"mnist_m_{split}_labels.txt").write_text("\n".join(lines) + "\n")
        parts.append((images, labels))
    return parts


def _resize(image: np.ndarray, size: int) -> np.ndarray:
    return np.asarray(Image.fromarray(image).resize((size, size), _BILINEAR))


def _rgb(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[..., None], 3, axis=-1)


def _read(root: Path, domain: str) -> dict:
    with Shard(root / "digits" / f"{domain}.h5") as shard:
        return {s: shard.load(s) for s in SPLITS}


def _check_exact(splits: dict, expected: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Every shard row is exactly one source image with its label; together they cover the source once."""
    images = np.concatenate([e[0] for e in expected])
    labels = np.concatenate([e[1] for e in expected])
    index = {images[i].tobytes(): i for i in range(len(images))}
    assert len(index) == len(images)
    seen = []
    for split in SPLITS:
        x, y = splits[split]
        for row in range(len(x)):
            i = index[x[row].tobytes()]
            assert y[row] == labels[i]
            seen.append(i)
    assert sorted(seen) == list(range(len(images)))


def _log():
    lines = []
    return lines, lines.append


def test_all_five_raw_domains_exact(tmp_path):
    src = tmp_path / "src"
    mnist = write_mnist(src / "MNIST" / "raw")
    svhn = write_mat(src / "svhn", "")
    usps = write_usps(src / "usps")
    synth = write_mat(src / "SynthDigits", "synth_", seed=5)
    mnistm = write_mnistm(src / "mnist_m")
    lines, log = _log()
    m = prepare_digits(src, tmp_path / "out", log=log)
    assert m.domains == sorted(DOMAINS)
    assert m.classes == [str(d) for d in range(10)]
    assert m.image_size == (28, 28) and m.channels == 3
    assert m.protocol["fedbn_partition_size"] == 743 and m.protocol["domains_missing"] == []
    assert any("found mnist, svhn, usps, synth, mnistm; missing none" in line for line in lines)
    out = tmp_path / "out"
    assert verify(out, "digits") == []
    # MNIST 28x28 grayscale: exact, replicated to 3 channels
    _check_exact(_read(out, "mnist"), [(_rgb(x), y) for x, y in mnist])
    # specific image: MNIST train image 0 is somewhere with its label
    got = _read(out, "mnist")
    rows = [(s, r) for s in SPLITS for r in range(len(got[s][0]))
            if np.array_equal(got[s][0][r], _rgb(mnist[0][0][0]))]
    assert len(rows) == 1 and got[rows[0][0]][1][rows[0][1]] == mnist[0][1][0]
    assert np.array_equal(got["train"][0][0][..., 0], got["train"][0][0][..., 2])
    # SVHN / synth: 32 -> 28 bilinear, label 10 -> 0
    for domain, parts in (("svhn", svhn), ("synth", synth)):
        _check_exact(_read(out, domain), [(np.stack([_resize(i, 28) for i in x]), y) for x, y in parts])
    assert 0 in np.concatenate([_read(out, "svhn")[s][1] for s in SPLITS])
    # USPS 16x16 floats -> uint8, resized, replicated
    _check_exact(_read(out, "usps"), [(_rgb(np.stack([_resize(i, 28) for i in x])), y) for x, y in usps])
    _check_exact(_read(out, "mnistm"), mnistm)


def test_loose_files_in_src_and_alternative_names_are_accepted(tmp_path):
    src = tmp_path / "src"
    usps = write_usps(src)  # --src/usps.h5
    svhn = write_mat(src, "")  # --src/{train,test}_32x32.mat, as torchvision stores SVHN
    mnistm = write_mnistm(src)  # --src/mnist_m_{train,test}/ and their label lists
    mnist = write_mnist(src / "Mnist", compress=False)
    for path in (src / "Mnist").iterdir():  # the unpacked names some mirrors use: train-images.idx3-ubyte
        path.rename(path.with_name(path.name.replace("-idx", ".idx").upper()))
    synth = write_mat(src / "Synth-Digits" / "raw", "synth_", seed=5)
    lines, log = _log()
    m = prepare_digits(src, tmp_path / "out", log=log)
    assert m.domains == sorted(DOMAINS)
    out = tmp_path / "out"
    _check_exact(_read(out, "usps"), [(_rgb(np.stack([_resize(i, 28) for i in x])), y) for x, y in usps])
    for domain, parts in (("svhn", svhn), ("synth", synth)):
        _check_exact(_read(out, domain), [(np.stack([_resize(i, 28) for i in x]), y) for x, y in parts])
    _check_exact(_read(out, "mnist"), [(_rgb(x), y) for x, y in mnist])
    _check_exact(_read(out, "mnistm"), mnistm)
    assert [line for line in lines if "found" not in line and ("->" in line or "from" in line)] == [
        "digits: domain folder 'Mnist' -> mnist", "digits: domain folder 'Synth-Digits' -> synth",
        "digits: svhn from train_32x32.mat in --src", "digits: usps from usps.h5 in --src",
        "digits: mnistm from mnist_m_train_labels.txt in --src"]
    with Shard(out / "digits" / "usps.h5") as shard:
        assert f"files in {src.resolve()}" in shard.source


def test_mnistm_inside_its_tarball_folder_and_a_domain_given_twice(tmp_path):
    src = tmp_path / "src"
    mnistm = write_mnistm(src / "MNIST-M" / "mnist_m")
    prepare_digits(src, tmp_path / "out")
    _check_exact(_read(tmp_path / "out", "mnistm"), mnistm)
    write_usps(src / "USPS")
    write_usps(src)
    with pytest.raises(MpiflError) as e:
        prepare_digits(src, tmp_path / "again")
    assert "domain usps is both folder 'USPS' and usps.h5" in str(e.value) and "\n" not in str(e.value)


def test_split_is_seeded_stratified_disjoint_and_deterministic(tmp_path):
    src = tmp_path / "src"
    write_mnist(src / "mnist")
    m1 = prepare_digits(src, tmp_path / "a")
    m2 = prepare_digits(src, tmp_path / "b")
    a, b = _read(tmp_path / "a", "mnist"), _read(tmp_path / "b", "mnist")
    for s in SPLITS:
        assert np.array_equal(a[s][0], b[s][0]) and np.array_equal(a[s][1], b[s][1])
    assert m1.splits == m2.splits
    # 9 images per class: 80/20 -> test round(1.8)=2, train 7; val round(0.7)=1 -> train 6
    counts = {s: np.bincount(a[s][1], minlength=10) for s in SPLITS}
    assert list(counts["test"]) == [2] * 10
    assert list(counts["val"]) == [1] * 10
    assert list(counts["train"]) == [6] * 10
    keys = [{x.tobytes() for x in a[s][0]} for s in SPLITS]
    assert not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    # rows sorted by class
    for s in SPLITS:
        assert list(a[s][1]) == sorted(a[s][1])


def test_subset_with_uncompressed_idx_and_size(tmp_path):
    src = tmp_path / "src"
    mnist = write_mnist(src / "mnist", compress=False)
    lines, log = _log()
    m = prepare_digits(src, tmp_path / "out", size=14, log=log)
    assert m.domains == ["mnist"] and m.image_size == (14, 14)
    assert m.protocol["domains_missing"] == ["svhn", "usps", "synth", "mnistm"]
    assert any("missing svhn, usps, synth, mnistm" in line for line in lines)
    _check_exact(_read(tmp_path / "out", "mnist"),
                 [(_rgb(np.stack([_resize(i, 14) for i in x])), y) for x, y in mnist])


def test_fedbn_pickles(tmp_path):
    src = tmp_path / "src"
    rng = np.random.default_rng(7)
    expected = {}
    for folder, domain, shape in (("MNIST", "mnist", (28, 28)), ("MNIST_M", "mnistm", (28, 28, 3))):
        (src / folder / "partitions").mkdir(parents=True)
        parts = []
        for k in range(3):
            labels = _labels(2, 10 + k)
            images = rng.integers(0, 256, (len(labels), *shape), dtype=np.uint8)
            with open(src / folder / "partitions" / f"train_part{k}.pkl", "wb") as f:
                pickle.dump((images, labels), f)
            parts.append((images, labels))
        test_labels = _labels(1, 20)
        test_images = rng.integers(0, 256, (10, *shape), dtype=np.uint8)
        with open(src / folder / "test.pkl", "wb") as f:
            pickle.dump((test_images, test_labels), f)
        expected[domain] = (parts, (test_images, test_labels))
    m = prepare_digits(src, tmp_path / "out")
    assert m.domains == ["mnist", "mnistm"] and "FedBN's split" in m.protocol["split"]
    for domain, (parts, (tx, ty)) in expected.items():
        got = _read(tmp_path / "out", domain)
        fix = _rgb if domain == "mnist" else (lambda a: a)
        assert np.array_equal(got["test"][0], fix(tx)) and np.array_equal(got["test"][1], ty)
        train_x = fix(np.concatenate([p[0] for p in parts]))
        train_y = np.concatenate([p[1] for p in parts])
        both = np.concatenate([got["train"][0], got["val"][0]])
        assert len(both) == len(train_x) == 60 and len(got["val"][0]) == 10
        _check_exact({"train": got["train"], "val": got["val"], "test": (tx[:0], ty[:0])},
                     [(train_x, train_y)])


class _Runs:
    """A pickle that calls ``call(*args)`` as it loads (what a tampered download would hold)."""

    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _fedbn_domain(folder: Path, parts, test) -> None:
    (folder / "partitions").mkdir(parents=True)
    for k, part in enumerate(parts):
        (folder / "partitions" / f"train_part{k}.pkl").write_bytes(part)
    (folder / "test.pkl").write_bytes(test)


@pytest.mark.parametrize("call", [os.system, eval])
@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])
def test_a_pickle_that_would_run_code_is_refused_before_it_runs(tmp_path, call, protocol):
    # the global as the file names it: protocol 2 writes Python 2's __builtin__ for builtins
    module = call.__module__ if call is os.system else ("__builtin__" if protocol < 3 else "builtins")
    refused = f"{module}.{call.__name__}"
    marker = tmp_path / "MARKER"
    payload = ((f"touch {marker}",) if call is os.system
               else (f"open({str(marker)!r}, 'w').close()",))
    images = np.zeros((10, 28, 28), np.uint8)
    good = pickle.dumps((images, np.arange(10)), protocol=protocol)
    # the payload rides inside an otherwise valid (images, labels) tuple, in the test file
    bad = pickle.dumps((images, _Runs(call, payload)), protocol=protocol)
    src = tmp_path / "src"
    _fedbn_domain(src / "MNIST", [good], bad)
    out = tmp_path / "out"
    with pytest.raises(MpiflError) as e:
        prepare_digits(src, out)
    message = str(e.value)
    assert not marker.exists()
    assert "\n" not in message
    assert f"{src / 'MNIST' / 'test.pkl'} refers to {refused}," in message
    assert "re-download FedBN's Digits-Five" in message
    assert _no_shards(out)


@pytest.mark.parametrize("protocol", [0, 2, 3, 4, 5, pickle.DEFAULT_PROTOCOL])
def test_numpy_array_pickles_load_in_every_protocol_and_under_numpy_1_names(tmp_path, protocol):
    rng = np.random.default_rng(protocol)
    images = rng.integers(0, 256, (10, 28, 28, 3), dtype=np.uint8)
    labels = np.arange(10, dtype=np.int64)
    data = pickle.dumps((images, labels), protocol=protocol)
    cases = {"now": data}
    if protocol <= 2:  # GLOBAL opcodes are text lines: write the names numpy 1.x and 2.x use
        cases["numpy1"] = data.replace(b"numpy._core.", b"numpy.core.")
        cases["numpy2"] = cases["numpy1"].replace(b"numpy.core.", b"numpy._core.")
        assert b"numpy.core.multiarray" in cases["numpy1"] and b"numpy._core.multiarray" in cases["numpy2"]
    # labels as a list of numpy scalars (multiarray.scalar) also load
    cases["scalars"] = pickle.dumps((images, [np.int64(v) for v in labels]), protocol=protocol)
    for name, blob in cases.items():
        path = tmp_path / f"{name}.pkl"
        path.write_bytes(blob)
        got_images, got_labels = _read_pickle(path, 28)
        assert np.array_equal(got_images, images) and np.array_equal(got_labels, labels), name


def _no_shards(out: Path):
    return not out.exists() or not list(out.rglob("*.h5*")) and not [p for p in out.iterdir()
                                                                   if p.name.startswith(".")]


@pytest.mark.parametrize("breakage, message", [
    ("missing_file", "t10k-labels-idx1-ubyte.gz is missing"),
    ("label_count", "labels for"),
    ("unknown_folder", "unknown domain folder 'fashion'"),
    ("none", "no digits domain folder"),
    ("mnistm_missing_png", "which is not in"),
    ("svhn_bad_mat", "no X and y"),
    ("mixed", "FedBN pickles"),
])
def test_malformed_sources_fail_cleanly(tmp_path, breakage, message):
    src = tmp_path / "src"
    src.mkdir()
    write_usps(src / "usps")  # a good domain converted first: its shard must not survive
    if breakage == "missing_file":
        write_mnist(src / "mnist")
        (src / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    elif breakage == "label_count":
        write_mnist(src / "mnist")
        _idx(src / "mnist" / "t10k-labels-idx1-ubyte.gz", np.zeros(3, np.uint8))
    elif breakage == "unknown_folder":
        (src / "fashion").mkdir()
    elif breakage == "none":
        import shutil
        shutil.rmtree(src / "usps")
        (src / "readme.txt").write_text("x")
    elif breakage == "mnistm_missing_png":
        write_mnistm(src / "mnistm")
        (src / "mnistm" / "mnist_m_test" / "00000002.png").unlink()
    elif breakage == "svhn_bad_mat":
        (src / "svhn").mkdir()
        for split in ("train", "test"):
            scipy.io.savemat(src / "svhn" / f"{split}_32x32.mat", {"images": np.zeros((2, 2))})
    elif breakage == "mixed":
        (src / "MNIST").mkdir()
        (src / "MNIST" / "test.pkl").write_bytes(b"")
    out = tmp_path / "out"
    with pytest.raises(MpiflError) as e:
        prepare_digits(src, out)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert _no_shards(out)


def _gzip_bomb(path: Path, dims: tuple[int, ...], inflated: int, forge_trailer: bool) -> None:
    """A gzip IDX file whose header announces ``dims`` and which inflates to ``inflated`` bytes of zeros (built in
    pieces: nothing that size is held or written); ``forge_trailer``: its trailer records the header's size."""
    header = struct.pack(">BBBB", 0, 0, 8, len(dims)) + struct.pack(f">{len(dims)}I", *dims)
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip format
    parts, zeros = [packer.compress(header)], bytes(1 << 24)
    for _ in range(inflated // len(zeros)):
        parts.append(packer.compress(zeros))
    data = b"".join(parts) + packer.flush()
    if forge_trailer:
        data = data[:-4] + struct.pack("<I", (len(header) + int(np.prod(dims))) % (1 << 32))
    path.write_bytes(data)


@pytest.mark.parametrize("forge_trailer,words", [
    (False, "gzip trailer and size say otherwise"),  # refused before inflating the data
    (True, "holds more data than its header (1000, 28, 28) says"),  # refused after reading what the header says
])
def test_a_gzip_bomb_is_refused_within_the_memory_its_header_announces(tmp_path, forge_trailer, words):
    src = tmp_path / "src"
    write_mnist(src / "mnist")
    bomb = src / "mnist" / "train-images-idx3-ubyte.gz"
    _gzip_bomb(bomb, (1000, 28, 28), 256 << 20, forge_trailer)
    assert bomb.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(MpiflError) as e:
            read_idx(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(bomb) in str(e.value) and words in str(e.value) and "download the file again" in str(e.value)
    assert peak < (1 << 20 if not forge_trailer else 16 << 20), peak  # the header's 0.8 MB and a piece or two
    with pytest.raises(MpiflError, match=re.escape(words)):
        prepare_digits(src, tmp_path / "out")
    assert _no_shards(tmp_path / "out")


def test_cli_prepare_digits(tmp_path):
    src = tmp_path / "src"
    write_mnist(src / "mnist")
    result = CliRunner().invoke(cli, ["prepare", "digits", "--src", str(src), "--data-root", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "digits: ready at" in result.output and "missing svhn" in result.output
    assert DatasetManifest.load(tmp_path / "out", "digits").splits["mnist"]["test"] == 20
    bad = CliRunner().invoke(cli, ["prepare", "digits", "--src", str(tmp_path / "out")])
    assert bad.exit_code == 2 and "mpifl: error: unknown domain folder 'digits'" in bad.output
