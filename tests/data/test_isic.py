"""Fed-ISIC2019 converter: FLamby's train/test per center read back exactly, carved val, errors."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from mpifl.data.__main__ import cli
from mpifl.data.images import load_image
from mpifl.data.isic import CENTERS, CLASSES, IMAGES, prepare_isic2019
from mpifl.data.manifest import verify
from mpifl.data.shard import SPLITS, Shard
from mpifl.data.splits import SPLIT_SEED
from mpifl.errors import MpiflError
from tests.data.test_folders import assert_refused_cleanly, assert_user_error

ONE_HOT = [*CLASSES, "UNK"]
HEADER = ["image", *ONE_HOT, "target", "center", "fold", "fold2"]
TRAIN_PER_CLASS = {c: 2 for c in range(len(CLASSES))} | {1: 10}  # NV: 10 -> 1 val image


def write_isic(src: Path, size=(8, 8), seed: int = 0) -> dict:
    """FLamby's layout in ``src``; returns image path -> (decoded pixels, label, center, fold, row)."""
    rng = np.random.default_rng(seed)
    images = src / IMAGES
    images.mkdir(parents=True)
    rows, written = [], {}
    for center in range(len(CENTERS)):
        entries = [(label, "train") for label, n in TRAIN_PER_CLASS.items() for _ in range(n)]
        entries += [(label, "test") for label in range(len(CLASSES))]
        for i in rng.permutation(len(entries)):  # classes and folds interleaved, as in FLamby's table
            label, fold = entries[i]
            name = f"ISIC_{len(rows):07d}" + ("_downsampled" if center == 4 else "")
            path = images / f"{name}.jpg"
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path, quality=95)
            with Image.open(path) as im:
                written[path] = (np.asarray(im.convert("RGB")), label, center, fold, len(rows))
            one_hot = [f"{float(k == label):.1f}" for k in range(len(ONE_HOT))]
            rows.append([name, *one_hot, label, center, fold, f"{fold}_{center}"])
    write_table(src, rows)
    return written


def write_table(src: Path, rows, header=HEADER, name="train_test_split") -> None:
    with open(src / name, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def read_table(src: Path) -> list[list[str]]:
    with open(src / "train_test_split", newline="") as f:
        return list(csv.reader(f))


def read_shards(out: Path) -> dict:
    found = {}
    for center in range(len(CENTERS)):
        with Shard(out / "isic2019" / f"center{center}.h5") as shard:
            assert (shard.domain, shard.classes) == (f"center{center}", CLASSES)
            assert CENTERS[center] in shard.source
            found[center] = {s: shard.load(s) for s in SPLITS}
    return found


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    src = tmp_path_factory.mktemp("isic_src")
    written = write_isic(src)
    out = tmp_path_factory.mktemp("out")
    return src, out, written, prepare_isic2019(src, out, size=8)


def test_reads_back_flamby_split_pixel_and_label_exact(converted):
    src, out, written, manifest = converted
    assert manifest.domains == [f"center{c}" for c in range(6)] and manifest.classes == CLASSES
    assert verify(out, "isic2019") == []
    by_bytes = {pixels.tobytes(): (path, label, center, fold, row)
                for path, (pixels, label, center, fold, row) in written.items()}
    assert len(by_bytes) == len(written)
    for center, splits in read_shards(out).items():
        entries = {}
        for split in SPLITS:
            images, labels = splits[split]
            entries[split] = [by_bytes[image.tobytes()] for image in images]
            assert all(e[2] == center for e in entries[split])
            assert [int(v) for v in labels] == [e[1] for e in entries[split]]
            rows = [e[4] for e in entries[split]]
            assert rows == sorted(rows)  # table order
        assert {e[0] for e in entries["test"]} == {p for p, w in written.items() if w[2] == center
                                                   and w[3] == "test"}
        assert {e[0] for e in entries["train"] + entries["val"]} == {
            p for p, w in written.items() if w[2] == center and w[3] == "train"}
        assert [e[1] for e in entries["val"]] == [1]  # 10 % of NV's 10; 10 % of 2 rounds to 0
    assert "fold column" in manifest.protocol["split"] and str(SPLIT_SEED) in manifest.protocol["split"]
    assert manifest.protocol["centers"]["center0"] == "BCN" and manifest.protocol["default_size"] == 224


def test_resizes_rectangular_images_and_accepts_csv_suffix(tmp_path):
    src = tmp_path / "src"
    written = write_isic(src, size=(11, 8), seed=2)
    (src / "train_test_split").rename(src / "train_test_split.csv")
    manifest = prepare_isic2019(src, tmp_path / "out", size=6)
    assert manifest.image_size == (6, 6)
    expected = {load_image(path, 6).tobytes(): w[1] for path, w in written.items()}
    count = 0
    for splits in read_shards(tmp_path / "out").values():
        for images, labels in splits.values():
            for image, label in zip(images, labels):
                assert expected[image.tobytes()] == label
                count += 1
    assert count == len(written)


def test_minimal_columns_suffice(tmp_path):
    src = tmp_path / "src"
    written = write_isic(src)
    rows = read_table(src)
    keep = [rows[0].index(c) for c in ("image", "target", "center", "fold")]
    write_table(src, [[r[i] for i in keep] for r in rows[1:]], header=["image", "target", "center", "fold"])
    manifest = prepare_isic2019(src, tmp_path / "out", size=8)
    assert sum(sum(s.values()) for s in manifest.splits.values()) == len(written)


def test_cli_prepare(tmp_path):
    src = tmp_path / "src"
    written = write_isic(src)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["prepare", "isic2019", "--src", str(src), "--size", "8",
                                      "--data-root", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"isic2019: ready at {out / 'isic2019'} (6 domains, {len(written)} images)\n"
    assert "center4 (MSK) train/val/test" in result.stderr


# ------------------------------------------------------------------ malformed sources


def _edit(src: Path, line: int, column: str, value) -> None:
    rows = read_table(src)
    rows[line][rows[0].index(column)] = str(value)
    write_table(src, rows[1:], header=rows[0])


def break_no_table(src):
    (src / "train_test_split").unlink()
    return ("no train_test_split", "dataset_creation_scripts")


def break_no_image_folder(src):
    shutil.rmtree(src / IMAGES)
    return ("no ISIC_2019_Training_Input_preprocessed/ folder",)


def break_missing_image(src):
    name = read_table(src)[12][0]
    (src / IMAGES / f"{name}.jpg").unlink()
    return ("line 13", name, "resize_images.py")


def break_unreadable_image(src):
    name = read_table(src)[-1][0]  # center 5, the last shard
    (src / IMAGES / f"{name}.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return ("cannot read image", name, "resize_images.py")


def break_unknown_class(src):
    _edit(src, 2, "target", 8)  # UNK: no training image in ISIC 2019
    return ("line 3", "target is '8'", "class 0..7")


def break_unknown_center(src):
    _edit(src, 5, "center", 6)
    return ("line 6", "center is '6'", "center 0..5")


def break_unknown_fold(src):
    _edit(src, 3, "fold", "val")
    return ("line 4", "fold is 'val'", "train or test")


def break_one_hot_mismatch(src):
    rows = read_table(src)
    target = int(rows[4][rows[0].index("target")])
    _edit(src, 4, "target", (target + 1) % 8)
    return ("line 5", "column", "labels disagree")


def break_fold2_mismatch(src):
    rows = read_table(src)
    _edit(src, 6, "fold2", "test_5" if rows[6][-1] != "test_5" else "train_5")
    return ("line 7", "fold2", "disagree")


def break_missing_column(src):
    rows = read_table(src)
    drop = rows[0].index("center")
    write_table(src, [r[:drop] + r[drop + 1:] for r in rows[1:]], header=rows[0][:drop] + rows[0][drop + 1:])
    return ("no column 'center'",)


def break_center_without_test(src):
    rows = read_table(src)
    write_table(src, [r for r in rows[1:] if r[-1] != "test_3"], header=rows[0])
    return ("no test image of center 3", "HAM_rosendahl")


@pytest.mark.parametrize("damage", [break_no_table, break_no_image_folder, break_missing_image,
                                    break_unreadable_image, break_unknown_class, break_unknown_center,
                                    break_unknown_fold, break_one_hot_mismatch, break_fold2_mismatch,
                                    break_missing_column, break_center_without_test])
def test_malformed_source_is_one_line_error_and_leaves_nothing(tmp_path, damage):
    src = tmp_path / "src"
    write_isic(src)
    words = damage(src)
    assert_refused_cleanly(lambda out: prepare_isic2019(src, out, size=8), tmp_path / "out", words)


def test_no_src(tmp_path):
    with pytest.raises(MpiflError) as excinfo:
        prepare_isic2019(None, tmp_path / "out")
    assert_user_error(excinfo, "--src", IMAGES)
