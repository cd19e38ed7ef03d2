"""FairFace converter: race domains, gender labels, official val as test, carved val, errors."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from mpifl.data.__main__ import cli
from mpifl.data.fairface import CLASSES, RACES, prepare_fairface
from mpifl.data.images import load_image
from mpifl.data.manifest import verify
from mpifl.data.shard import SPLITS, Shard
from mpifl.data.splits import SPLIT_SEED
from mpifl.errors import MpiflError
from tests.data.test_folders import assert_refused_cleanly, assert_user_error

HEADER = ["file", "age", "gender", "race", "service_test"]
PER_GENDER = {"train": 10, "val": 2}  # per race: val carved = 1 per gender, test = 2 per gender
TABLE = {"train": "fairface_label_train.csv", "val": "fairface_label_val.csv"}


def write_fairface(src: Path, size: int = 8, seed: int = 0) -> dict:
    """FairFace's layout in ``src``; returns image path -> (decoded pixels, label, domain, table, row)."""
    rng = np.random.default_rng(seed)
    written = {}
    for table, per_gender in PER_GENDER.items():
        (src / table).mkdir(parents=True)
        entries = [(race, gender) for race in RACES for gender in CLASSES for _ in range(per_gender)]
        rows = []
        for i in rng.permutation(len(entries)):
            race, gender = entries[i]
            file = f"{table}/{len(rows) + 1}.jpg"
            path = src / file
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path, quality=95)
            with Image.open(path) as im:
                written[path] = (np.asarray(im.convert("RGB")), CLASSES.index(gender), RACES[race], table,
                                 len(rows))
            rows.append([file, "20-29", gender, race, "True"])
        write_table(src, table, rows)
    return written


def write_table(src: Path, table: str, rows, header=HEADER) -> None:
    with open(src / TABLE[table], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def read_table(src: Path, table: str) -> list[list[str]]:
    with open(src / TABLE[table], newline="") as f:
        return list(csv.reader(f))


def read_shards(out: Path) -> dict:
    found = {}
    for domain in sorted(RACES.values()):
        with Shard(out / "fairface" / f"{domain}.h5") as shard:
            assert (shard.domain, shard.classes) == (domain, ["Male", "Female"])
            found[domain] = {s: shard.load(s) for s in SPLITS}
    return found


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    src = tmp_path_factory.mktemp("fairface_src")
    written = write_fairface(src)
    out = tmp_path_factory.mktemp("out")
    return src, out, written, prepare_fairface(src, out, size=8)


def test_reads_back_pixel_and_label_exact_per_race(converted):
    src, out, written, manifest = converted
    assert manifest.domains == ["black", "east_asian", "indian", "latino_hispanic", "middle_eastern",
                                "southeast_asian", "white"]
    assert manifest.classes == ["Male", "Female"] and manifest.image_size == (8, 8)
    assert verify(out, "fairface") == []
    by_bytes = {w[0].tobytes(): (path, *w[1:]) for path, w in written.items()}
    assert len(by_bytes) == len(written)
    for domain, splits in read_shards(out).items():
        entries = {}
        for split, per_gender in zip(SPLITS, (9, 1, 2)):
            images, labels = splits[split]
            entries[split] = [by_bytes[image.tobytes()] for image in images]
            assert all(e[2] == domain for e in entries[split])
            assert [int(v) for v in labels] == [e[1] for e in entries[split]]
            assert list(np.bincount(labels, minlength=2)) == [per_gender, per_gender]
            rows = [e[4] for e in entries[split]]
            assert rows == sorted(rows)  # table order
        assert all(e[3] == "val" for e in entries["test"])  # the official val table is the test split
        assert all(e[3] == "train" for e in entries["train"] + entries["val"])
    assert "test = fairface_label_val.csv" in manifest.protocol["split"]
    assert str(SPLIT_SEED) in manifest.protocol["split"] and manifest.protocol["default_size"] == 224


def test_resizing_matches_the_decoder(tmp_path):
    src = tmp_path / "src"
    written = write_fairface(src, size=10, seed=3)
    manifest = prepare_fairface(src, tmp_path / "out", size=4)
    assert manifest.image_size == (4, 4)
    expected = {load_image(path, 4).tobytes(): w[1] for path, w in written.items()}
    count = 0
    for splits in read_shards(tmp_path / "out").values():
        for images, labels in splits.values():
            for image, label in zip(images, labels):
                assert expected[image.tobytes()] == label
                count += 1
    assert count == len(written)


def test_cli_prepare(tmp_path):
    src = tmp_path / "src"
    written = write_fairface(src)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["prepare", "fairface", "--src", str(src), "--size", "8",
                                      "--data-root", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"fairface: ready at {out / 'fairface'} (7 domains, {len(written)} images)\n"


# ------------------------------------------------------------------ malformed sources


def _edit(src: Path, table: str, line: int, column: str, value) -> None:
    rows = read_table(src, table)
    rows[line - 1][rows[0].index(column)] = str(value)
    write_table(src, table, rows[1:], header=rows[0])


def break_no_val_table(src):
    (src / TABLE["val"]).unlink()
    return ("fairface_label_val.csv is missing",)


def break_missing_image(src):
    file = read_table(src, "train")[7][0]
    (src / file).unlink()
    return ("fairface_label_train.csv line 8", file, "not in")


def break_unreadable_image(src):
    file = read_table(src, "val")[3][0]
    (src / file).write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return ("cannot read image", file, "image zip")


def break_unknown_race(src):
    _edit(src, "val", 5, "race", "Martian")
    return ("fairface_label_val.csv line 5", "unknown race 'Martian'", "East Asian")


def break_unknown_gender(src):
    _edit(src, "train", 3, "gender", "male")
    return ("line 3", "gender is 'male'", "Male or Female")


def break_missing_column(src):
    rows = read_table(src, "train")
    write_table(src, "train", [r[:3] + r[4:] for r in rows[1:]], header=rows[0][:3] + rows[0][4:])
    return ("fairface_label_train.csv has no column 'race'",)


def break_path_outside_src(src):
    _edit(src, "train", 2, "file", "../elsewhere.jpg")
    (src.parent / "elsewhere.jpg").write_bytes((src / read_table(src, "train")[2][0]).read_bytes())
    return ("line 2", "../elsewhere.jpg")


def break_race_missing_from_val(src):
    rows = read_table(src, "val")
    write_table(src, "val", [r for r in rows[1:] if r[3] != "Indian"], header=rows[0])
    return ("fairface_label_val.csv lists no image of race 'Indian'",)


@pytest.mark.parametrize("damage", [break_no_val_table, break_missing_image, break_unreadable_image,
                                    break_unknown_race, break_unknown_gender, break_missing_column,
                                    break_path_outside_src, break_race_missing_from_val])
def test_malformed_source_is_one_line_error_and_leaves_nothing(tmp_path, damage):
    src = tmp_path / "src"
    write_fairface(src)
    words = damage(src)
    assert_refused_cleanly(lambda out: prepare_fairface(src, out, size=8), tmp_path / "out", words)


def test_no_src(tmp_path):
    with pytest.raises(MpiflError) as excinfo:
        prepare_fairface(None, tmp_path / "out")
    assert_user_error(excinfo, "--src", "fairface_label_train.csv")
