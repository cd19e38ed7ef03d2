"""CIFAR-10 and CIFAR-10-C converters: exact read-back, seeded splits, severity slices, errors."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mpifl.data.__main__ import cli
from mpifl.data.cifar import CIFAR10_CLASSES, prepare_cifar10, prepare_cifar10c
from mpifl.data.manifest import verify
from mpifl.data.shard import SPLITS, Shard
from mpifl.errors import MpiflError

PER_BATCH = 20  # images per data batch (2 per class)


def write_cifar10(folder: Path, seed=0):
    """The python batches (real dict format, bytes keys); returns (train images, labels, test images, labels)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = [], []
    for k in range(1, 7):
        y = rng.permutation(np.repeat(np.arange(10), PER_BATCH // 10))
        x = rng.integers(0, 256, (PER_BATCH, 32, 32, 3), dtype=np.uint8)
        batch = {b"batch_label": b"batch", b"labels": [int(v) for v in y],
                 b"data": x.transpose(0, 3, 1, 2).reshape(PER_BATCH, 3072),
                 b"filenames": [b"f%d.png" % i for i in range(PER_BATCH)]}
        name = f"data_batch_{k}" if k < 6 else "test_batch"
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
        images.append(x)
        labels.append(y)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_vis": 3072}, f)
    return np.concatenate(images[:5]), np.concatenate(labels[:5]), images[5], labels[5]


def _read(root: Path, name: str, domain: str) -> dict:
    with Shard(root / name / f"{domain}.h5") as shard:
        return {s: shard.load(s) for s in SPLITS}


def test_cifar10_exact(tmp_path):
    src = tmp_path / "src"
    x, y, tx, ty = write_cifar10(src / "cifar-10-batches-py")
    m = prepare_cifar10(src, tmp_path / "out")
    assert m.domains == ["cifar10"] and m.classes == CIFAR10_CLASSES and m.image_size == (32, 32)
    assert verify(tmp_path / "out", "cifar10") == []
    got = _read(tmp_path / "out", "cifar10", "cifar10")
    assert np.array_equal(got["test"][0], tx) and np.array_equal(got["test"][1], ty)
    # train + val = all 100 train images, each once, in file order within a split, with their labels
    index = {x[i].tobytes(): i for i in range(len(x))}
    rows = {s: [index[img.tobytes()] for img in got[s][0]] for s in ("train", "val")}
    assert sorted(rows["train"] + rows["val"]) == list(range(len(x)))
    for s in ("train", "val"):
        assert rows[s] == sorted(rows[s])
        assert np.array_equal(got[s][1], y[rows[s]])
    assert list(np.bincount(got["val"][1], minlength=10)) == [1] * 10  # 10 per class -> 1 val
    # a specific image: train image 0 (R plane first in the file) keeps its pixels
    where = rows["train"].index(0) if 0 in rows["train"] else None
    split = "train" if where is not None else "val"
    where = where if where is not None else rows["val"].index(0)
    assert np.array_equal(got[split][0][where], x[0])
    # deterministic
    prepare_cifar10(src / "cifar-10-batches-py", tmp_path / "again")
    again = _read(tmp_path / "again", "cifar10", "cifar10")
    assert all(np.array_equal(again[s][0], got[s][0]) for s in SPLITS)


def test_cifar10_resize_and_errors(tmp_path):
    src = tmp_path / "src"
    write_cifar10(src)
    m = prepare_cifar10(src, tmp_path / "out", size=16)
    assert m.image_size == (16, 16)
    (src / "data_batch_3").unlink()
    with pytest.raises(MpiflError, match="data_batch_3 is missing"):
        prepare_cifar10(src, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_cifar10_label_count_mismatch_leaves_nothing(tmp_path):
    src = tmp_path / "src"
    write_cifar10(src)
    with open(src / "test_batch", "rb") as f:
        batch = pickle.load(f)
    batch[b"labels"] = batch[b"labels"][:-1]
    with open(src / "test_batch", "wb") as f:
        pickle.dump(batch, f)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(MpiflError) as e:
        prepare_cifar10(src, out)
    assert "19 labels for 20 images" in str(e.value) and "\n" not in str(e.value)
    assert list(out.iterdir()) == []


def write_cifar10c(folder: Path, corruptions=("fog", "snow"), n=100, seed=1):
    """n images per severity (the real files have 10,000; the converter's slice is patched)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    labels = np.concatenate([rng.permutation(np.repeat(np.arange(10), n // 10)) for _ in range(5)])
    np.save(folder / "labels.npy", labels.astype(np.uint8))
    arrays = {}
    for c in corruptions:
        arrays[c] = rng.integers(0, 256, (5 * n, 32, 32, 3), dtype=np.uint8)
        np.save(folder / f"{c}.npy", arrays[c])
    return labels, arrays


@pytest.fixture
def small_severity(monkeypatch):
    import mpifl.data.cifar as cifar
    monkeypatch.setattr(cifar, "_PER_SEVERITY", 100)


def test_cifar10c_exact_split_and_severity(tmp_path, small_severity):
    src = tmp_path / "src"
    labels, arrays = write_cifar10c(src / "CIFAR-10-C")
    for severity in (5, 2):
        out = tmp_path / f"out{severity}"
        m = prepare_cifar10c(src, out, severity=severity)
        assert m.domains == ["fog", "snow"] and m.classes == CIFAR10_CLASSES
        assert m.protocol["severity"] == severity and verify(out, "cifar10c") == []
        lo = (severity - 1) * 100
        sets = {}
        for c in ("fog", "snow"):
            got = _read(out, "cifar10c", c)
            block, block_labels = arrays[c][lo:lo + 100], labels[lo:lo + 100]
            index = {block[i].tobytes(): i for i in range(100)}
            rows = {s: [index[img.tobytes()] for img in got[s][0]] for s in SPLITS}
            assert sorted(sum(rows.values(), [])) == list(range(100))
            for s in SPLITS:
                assert np.array_equal(got[s][1], block_labels[rows[s]])
            assert [len(rows[s]) for s in SPLITS] == [70, 10, 20]
            assert list(np.bincount(got["test"][1], minlength=10)) == [2] * 10
            sets[c] = rows
        assert sets["fog"] == sets["snow"]  # the same split in every corruption


def test_cifar10c_errors(tmp_path, small_severity):
    src = tmp_path / "src"
    write_cifar10c(src)
    np.save(src / "rain.npy", np.zeros((500, 32, 32, 3), np.uint8))
    with pytest.raises(MpiflError, match="unknown corruption file rain.npy"):
        prepare_cifar10c(src, tmp_path / "out")
    (src / "rain.npy").unlink()
    np.save(src / "snow.npy", np.zeros((499, 32, 32, 3), np.uint8))  # converted after fog: fog's shard
    out = tmp_path / "out"
    with pytest.raises(MpiflError) as e:
        prepare_cifar10c(src, out, severity=1)
    assert "499 images but labels.npy has 500" in str(e.value)
    assert not out.exists()
    with pytest.raises(MpiflError, match="no CIFAR-10-C labels.npy"):
        prepare_cifar10c(tmp_path, tmp_path / "out2")


def test_cli_severity(tmp_path, small_severity):
    src = tmp_path / "src"
    write_cifar10c(src, corruptions=("fog",))
    runner = CliRunner()
    result = runner.invoke(cli, ["prepare", "cifar10c", "--src", str(src), "--data-root", str(tmp_path / "o"),
                                 "--severity", "3"])
    assert result.exit_code == 0, result.output
    assert "cifar10c: ready at" in result.output
    bad = runner.invoke(cli, ["prepare", "digits", "--src", str(src), "--severity", "3"])
    assert bad.exit_code == 2 and "--severity does not apply to digits" in bad.output
    write_cifar10(tmp_path / "c10")
    ok = runner.invoke(cli, ["prepare", "cifar10", "--src", str(tmp_path / "c10"), "--data-root",
                             str(tmp_path / "o")])
    assert ok.exit_code == 0, ok.output


class _Runs:
    """Pickles as a call of ``os.system``: what a tampered batch would run while it loads."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_batch_that_would_run_code_is_refused_before_it_runs(tmp_path):
    src = tmp_path / "src"
    write_cifar10(src)
    marker = tmp_path / "MARKER"
    with open(src / "data_batch_2", "rb") as f:
        batch = pickle.load(f)
    batch[b"labels"] = _Runs(f"touch {marker}")
    with open(src / "data_batch_2", "wb") as f:
        pickle.dump(batch, f, protocol=2)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(MpiflError) as e:
        prepare_cifar10(src, out)
    assert not marker.exists()
    message = str(e.value)
    assert f"{src / 'data_batch_2'} refers to {os.system.__module__}.system," in message and "\n" not in message
    assert "unpack the official cifar-10-python.tar.gz again" in message
    assert list(out.iterdir()) == []
