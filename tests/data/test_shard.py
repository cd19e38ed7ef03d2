"""HDF5 shard format: writing, reading back exactly, and rejecting bad shards."""

import hashlib
import json

import h5py
import numpy as np
import pytest

from mpifl import __version__
from mpifl.data.shard import CHUNK_BYTES, FORMAT_VERSION, Shard, ShardWriter
from mpifl.errors import MpiflError

H, W, C = 6, 5, 3
CLASSES = ["cat", "dog", "eel", "fox"]


def writer(path, **overrides):
    args = dict(dataset="toy", domain="sketch", classes=CLASSES, image_size=(H, W), channels=C,
                source="unit test")
    args.update(overrides)
    return ShardWriter(path, **args)


def random_split(rng, n):
    return (rng.integers(0, 256, (n, H, W, C), dtype=np.uint8),
            rng.integers(0, len(CLASSES), n).astype(np.int64))


def write_toy(path, rng, sizes=(("train", 70), ("train", 1), ("train", 29), ("val", 12))):
    """Write the toy shard, several chunks per split; return the concatenated splits."""
    parts = {"train": [], "val": [], "test": []}
    with writer(path) as w:
        for split, n in sizes:
            x, y = random_split(rng, n)
            w.add(split, x, y)
            parts[split].append((x, y))
    return {s: (np.concatenate([x for x, _ in p]) if p else np.zeros((0, H, W, C), np.uint8),
                np.concatenate([y for _, y in p]) if p else np.zeros(0, np.int64))
            for s, p in parts.items()}


def assert_one_line_about(error, path):
    message = str(error.value)
    assert "\n" not in message
    assert str(path) in message


def test_round_trip_is_exact_and_attributes_are_written(tmp_path):
    path = tmp_path / "toy" / "sketch.h5"
    data = write_toy(path, np.random.default_rng(0))
    assert sorted(p.name for p in path.parent.iterdir()) == ["sketch.h5"]
    with Shard(path) as shard:
        assert shard.sizes == {"train": 100, "val": 12, "test": 0}
        assert (shard.dataset, shard.domain, shard.source) == ("toy", "sketch", "unit test")
        assert shard.classes == CLASSES and shard.num_classes == 4
        assert shard.image_size == (H, W) and shard.channels == C
        for split, (x, y) in data.items():
            got_x, got_y = shard.load(split)
            assert got_x.dtype == np.uint8 and got_y.dtype == np.int64
            assert got_x.shape == (len(x), H, W, C)
            np.testing.assert_array_equal(got_x, x)
            np.testing.assert_array_equal(got_y, y)
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] == FORMAT_VERSION
        assert json.loads(f.attrs["classes"]) == CLASSES
        assert list(f.attrs["image_size"]) == [H, W]
        assert f.attrs["created_by"] == f"mpifl {__version__}"
        assert f["test/images"].shape == (0, H, W, C) and f["test/labels"].shape == (0,)
        assert f["train/labels"].dtype == np.int64


def _content(data, domain="sketch", task="classification", classes=CLASSES, channels=C):
    """The content checksum of ``data`` ({split: (images, labels)}) as the shard format defines it, computed
    here from the arrays."""
    identity = {"dataset": "toy", "domain": domain, "task": task, "classes": classes, "image_size": [H, W],
                "channels": channels}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    for split in ("train", "val", "test"):
        x, y = data[split]
        y = y if task == "segmentation" else y.astype("<i8")
        digest.update(f"\n{split} {len(x)} {hashlib.sha256(x.tobytes()).hexdigest()} "
                      f"{hashlib.sha256(y.tobytes()).hexdigest()}".encode())
    return digest.hexdigest()


def test_a_shard_carries_the_checksum_of_its_content_whatever_batches_or_source_wrote_it(tmp_path):
    data = write_toy(tmp_path / "a.h5", np.random.default_rng(0))
    with Shard(tmp_path / "a.h5") as shard:
        first = shard.content
    assert first == _content(data)
    with writer(tmp_path / "b.h5", source="elsewhere") as w:  # the same content, in other batches, val first
        w.add("val", *data["val"])
        for rows in (slice(0, 50), slice(50, 100)):
            w.add("train", data["train"][0][rows], data["train"][1][rows])
    data["train"][0][7, 1, 2, 0] ^= 1  # one pixel
    with writer(tmp_path / "c.h5") as w:
        w.add("train", *data["train"])
        w.add("val", *data["val"])
    with Shard(tmp_path / "b.h5") as same, Shard(tmp_path / "c.h5") as other:
        assert same.content == first and other.content == _content(data) != first
    with h5py.File(tmp_path / "a.h5", "a") as f:
        del f.attrs["content_sha256"]  # as a shard written before the checksum existed
    with Shard(tmp_path / "a.h5") as old:
        assert old.content is None


def test_train_mean_and_std_match_numpy(tmp_path):
    path = tmp_path / "sketch.h5"
    data = write_toy(path, np.random.default_rng(1))
    pixels = data["train"][0].reshape(-1, C) / 255.0
    with Shard(path) as shard:
        np.testing.assert_allclose(shard.mean, pixels.mean(axis=0), rtol=0, atol=1e-12)
        np.testing.assert_allclose(shard.std, pixels.std(axis=0), rtol=0, atol=1e-12)
        assert shard.mean.shape == (C,) and shard.mean.dtype == np.float64


def test_empty_train_split_gives_nan_statistics(tmp_path):
    path = tmp_path / "sketch.h5"
    write_toy(path, np.random.default_rng(1), sizes=(("test", 3),))
    with Shard(path) as shard:
        assert shard.sizes == {"train": 0, "val": 0, "test": 3}
        assert np.isnan(shard.mean).all() and np.isnan(shard.std).all()


@pytest.mark.parametrize("indices", [[5, 0, 17, 5, 3], [99, 98, 97, 0], [0, 99], [42], []])
def test_load_indices_returns_rows_in_the_given_order(tmp_path, indices):
    path = tmp_path / "sketch.h5"
    x, y = write_toy(path, np.random.default_rng(2))["train"]
    with Shard(path) as shard:
        got_x, got_y = shard.load("train", np.array(indices, dtype=np.int64))
    np.testing.assert_array_equal(got_x, x[indices])
    np.testing.assert_array_equal(got_y, y[indices])
    assert got_x.shape == (len(indices), H, W, C)


def test_load_rejects_indices_out_of_range(tmp_path):
    path = tmp_path / "sketch.h5"
    write_toy(path, np.random.default_rng(2))
    with Shard(path) as shard, pytest.raises(IndexError):
        shard.load("val", [12])


def test_images_are_chunked_along_n_uncompressed(tmp_path):
    path = tmp_path / "big.h5"
    size = (256, 256)
    with writer(path, image_size=size) as w:
        w.add("train", np.zeros((40, *size, C), np.uint8), np.zeros(40, np.int64))
        w.add("val", np.zeros((2, *size, C), np.uint8), np.zeros(2, np.int64))
    with h5py.File(path, "r") as f:
        rows = CHUNK_BYTES // (256 * 256 * C)
        assert f["train/images"].chunks == (rows, *size, C)
        assert f["val/images"].chunks == (2, *size, C)  # a small first batch sets a small chunk
        assert f["test/images"].chunks == (rows, *size, C)
        assert f["train/labels"].chunks == (40,) and f["test/labels"].chunks == (4096,)
        assert f["train/images"].compression is None
        assert f["train/images"].maxshape == (None, *size, C)


def test_writer_that_raises_leaves_no_file(tmp_path):
    path = tmp_path / "sketch.h5"
    with pytest.raises(RuntimeError):
        with writer(path) as w:
            w.add("train", *random_split(np.random.default_rng(3), 10))
            assert any(tmp_path.iterdir())  # the temporary file exists meanwhile
            raise RuntimeError("converter failed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("split, images, labels, words", [
    ("train", np.zeros((2, H, W, C), np.float32), np.zeros(2, int), "uint8"),
    ("train", np.zeros((2, H, W + 1, C), np.uint8), np.zeros(2, int), "shape"),
    ("train", np.zeros((2, H, W), np.uint8), np.zeros(2, int), "shape"),
    ("train", np.zeros((2, H, W, C), np.uint8), np.zeros(3, int), "labels"),
    ("train", np.zeros((2, H, W, C), np.uint8), np.array([0.0, 1.0]), "labels"),
    ("train", np.zeros((2, H, W, C), np.uint8), np.array([0, 4]), "0..3"),
    ("train", np.zeros((2, H, W, C), np.uint8), np.array([-1, 0]), "0..3"),
    ("holdout", np.zeros((2, H, W, C), np.uint8), np.zeros(2, int), "split"),
])
def test_add_validates_and_aborts_cleanly(tmp_path, split, images, labels, words):
    path = tmp_path / "sketch.h5"
    with pytest.raises(MpiflError) as error:
        with writer(path) as w:
            w.add(split, images, labels)
    assert words in str(error.value)
    assert_one_line_about(error, path)
    assert list(tmp_path.iterdir()) == []


def test_missing_file_names_path_and_fix(tmp_path):
    path = tmp_path / "pacs" / "sketch.h5"
    with pytest.raises(MpiflError) as error:
        Shard(path)
    assert_one_line_about(error, path)
    assert "shard missing" in str(error.value)
    assert "python -m mpifl.data prepare pacs" in str(error.value)


def test_non_hdf5_file_is_rejected(tmp_path):
    path = tmp_path / "sketch.h5"
    path.write_text("not hdf5")
    with pytest.raises(MpiflError, match="not an HDF5 file") as error:
        Shard(path)
    assert_one_line_about(error, path)


def edit(path, fn):
    with h5py.File(path, "a") as f:
        fn(f)


@pytest.mark.parametrize("damage, words", [
    (lambda f: f.attrs.__setitem__("format_version", 2), "format version 2"),
    (lambda f: f.attrs.__delitem__("mean"), "missing attributes mean"),
    (lambda f: f.attrs.__setitem__("classes", "cat,dog"), "classes"),
    (lambda f: f.__delitem__("val"), "group val"),
    (lambda f: (f.__delitem__("val/images"),
                f.create_dataset("val/images", data=np.zeros((12, H, W, C), np.float32))), "val/images"),
    (lambda f: (f.__delitem__("val/images"),
                f.create_dataset("val/images", data=np.zeros((12, H + 1, W, C), np.uint8))), "val/images"),
    (lambda f: (f.__delitem__("val/labels"),
                f.create_dataset("val/labels", data=np.zeros(11, np.int64))), "val/labels"),
])
def test_damaged_shard_is_rejected_on_open(tmp_path, damage, words):
    path = tmp_path / "sketch.h5"
    write_toy(path, np.random.default_rng(4))
    edit(path, damage)
    with pytest.raises(MpiflError) as error:
        Shard(path)
    assert words in str(error.value)
    assert_one_line_about(error, path)


def test_labels_out_of_range_are_rejected_on_load(tmp_path):
    path = tmp_path / "sketch.h5"
    write_toy(path, np.random.default_rng(5))

    def corrupt(f):
        f["val/labels"][3] = 7

    edit(path, corrupt)
    with Shard(path) as shard:
        shard.load("train")
        for load in (lambda: shard.load("val"), lambda: shard.load("val", [3]), lambda: shard.labels("val")):
            with pytest.raises(MpiflError, match="expected 0..3") as error:
                load()
            assert_one_line_about(error, path)
        shard.load("val", [0, 1, 2])  # rows with valid labels still load


def _masks(n, seed=0):
    return np.random.default_rng(seed).integers(0, 2, (n, 6, 5), dtype=np.uint8)


def test_a_segmentation_shard_keeps_uint8_masks_and_its_task(tmp_path):
    path = tmp_path / "site.h5"
    images = np.random.default_rng(1).integers(0, 256, (4, 6, 5, 1), dtype=np.uint8)
    with ShardWriter(path, dataset="toy", domain="site", classes=["background", "prostate"], image_size=(6, 5),
                     channels=1, source="t", task="segmentation") as writer:
        writer.add("train", images, _masks(4))
        writer.add("test", images[:2], _masks(2, 1))
    with Shard(path) as shard:
        assert shard.task == "segmentation" and shard.sizes == {"train": 4, "val": 0, "test": 2}
        assert shard.content == _content({"train": (images, _masks(4)), "val": (images[:0], _masks(0)),
                                          "test": (images[:2], _masks(2, 1))}, "site", "segmentation",
                                         ["background", "prostate"], 1)
        x, y = shard.load("train", indices=[3, 0])
        assert y.dtype == np.uint8 and np.array_equal(y, _masks(4)[[3, 0]]) and np.array_equal(x, images[[3, 0]])
        assert np.array_equal(shard.labels("test"), _masks(2, 1))
    with ShardWriter(tmp_path / "b.h5", dataset="toy", domain="b", classes=["background", "prostate"],
                     image_size=(6, 5), channels=1, source="t", task="segmentation") as writer:
        with pytest.raises(MpiflError, match=r"train masks must be uint8 of shape \(4, 6, 5\), got int64 \(4,\)"):
            writer.add("train", images, np.zeros(4, dtype=np.int64))
        with pytest.raises(MpiflError, match=r"train labels span 0\.\.2, expected 0\.\.1"):
            writer.add("train", images, _masks(4) * 2)


def test_a_shard_without_a_task_attribute_is_a_classification_one(tmp_path):
    path = tmp_path / "d.h5"
    with ShardWriter(path, dataset="toy", domain="d", classes=["a", "b"], image_size=(2, 2), channels=1,
                     source="t") as writer:
        writer.add("train", np.zeros((2, 2, 2, 1), np.uint8), np.array([0, 1]))
    with h5py.File(path, "a") as f:
        del f.attrs["task"]
    with Shard(path) as shard:
        assert shard.task == "classification" and shard.labels("train").dtype == np.int64
