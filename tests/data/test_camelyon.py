"""Camelyon17-WILDS converter: exact read-back per hospital, seeded split, --src levels, errors."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from mpifl.data.__main__ import cli
from mpifl.data.camelyon import CLASSES, HOSPITALS, prepare_camelyon17
from mpifl.data.images import load_image
from mpifl.data.manifest import verify
from mpifl.data.shard import SPLITS, Shard
from mpifl.data.splits import SPLIT_SEED
from mpifl.errors import MpiflError
from tests.data.test_folders import assert_nothing_left, assert_refused_cleanly, assert_user_error

PER_CLASS = 10  # patches per hospital and label: 70/10/20 -> 7/1/2
HEADER = ["", "patient", "node", "x_coord", "y_coord", "tumor", "slide", "center", "split"]


def write_camelyon(root: Path, size: int = 8, seed: int = 0) -> dict:
    """``root/camelyon17_v1.0`` in WILDS' layout; returns patch path -> (pixels, label, hospital, row)."""
    folder = root / "camelyon17_v1.0"
    rng = np.random.default_rng(seed)
    rows, written = [], {}
    for hospital in range(HOSPITALS):
        for k in range(2 * PER_CLASS):
            patient, node = 10 * hospital + k % 2, k % 3  # two patients, three nodes a hospital
            x, y = 96 * k, 32 * hospital + 7
            slide = f"patient_{patient:03d}_node_{node}"
            path = folder / "patches" / slide / f"patch_{slide}_x_{x}_y_{y}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path)
            label = (k * 7 + hospital) % 2  # labels interleaved in table order
            written[path] = (pixels, label, hospital, len(rows))
            rows.append([len(rows), f"{patient:03d}", node, x, y, label, 3 * hospital + node, hospital,
                         int(hospital == 2)])
    write_metadata(folder, rows)
    return written


def write_metadata(folder: Path, rows, header=HEADER) -> None:
    with open(folder / "metadata.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def read_metadata(folder: Path) -> list[list[str]]:
    with open(folder / "metadata.csv", newline="") as f:
        return list(csv.reader(f))


def read_shards(out: Path) -> dict:
    found = {}
    for hospital in range(HOSPITALS):
        with Shard(out / "camelyon17" / f"hospital{hospital}.h5") as shard:
            assert (shard.dataset, shard.domain, shard.classes) == ("camelyon17", f"hospital{hospital}",
                                                                     CLASSES)
            found[hospital] = {s: shard.load(s) for s in SPLITS}
    return found


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    src = tmp_path_factory.mktemp("camelyon_src")
    written = write_camelyon(src)
    out = tmp_path_factory.mktemp("out")
    manifest = prepare_camelyon17(src, out, size=8)
    return src, out, written, manifest


def test_reads_back_pixel_and_label_exact_per_hospital(converted):
    src, out, written, manifest = converted
    assert manifest.domains == [f"hospital{h}" for h in range(HOSPITALS)]
    assert manifest.classes == CLASSES and manifest.image_size == (8, 8)
    assert verify(out, "camelyon17") == []
    by_bytes = {pixels.tobytes(): (path, label, hospital, row)
                for path, (pixels, label, hospital, row) in written.items()}
    for hospital, splits in read_shards(out).items():
        seen = []
        for split, per_class in zip(SPLITS, (7, 1, 2)):
            images, labels = splits[split]
            entries = [by_bytes[image.tobytes()] for image in images]
            assert all(h == hospital for _, _, h, _ in entries)
            assert [int(v) for v in labels] == [label for _, label, _, _ in entries]
            assert list(np.bincount(labels, minlength=2)) == [per_class, per_class]
            order = [row for _, _, _, row in entries]
            assert order == sorted(order)  # metadata.csv order within a split
            seen += [path for path, _, _, _ in entries]
        assert sorted(seen) == sorted(p for p, (_, _, h, _) in written.items() if h == hospital)
    assert str(SPLIT_SEED) in manifest.protocol["split"] and "per hospital" in manifest.protocol["split"]
    assert "WILDS" in manifest.protocol["split_origin"] and manifest.protocol["default_size"] == 96


def test_src_may_be_the_folder_of_metadata_and_result_is_deterministic(converted, tmp_path):
    src, out, _, _ = converted
    prepare_camelyon17(src / "camelyon17_v1.0", tmp_path, size=8)
    again, first = read_shards(tmp_path), read_shards(out)
    for hospital in range(HOSPITALS):
        for split in SPLITS:
            assert np.array_equal(again[hospital][split][0], first[hospital][split][0])
            assert np.array_equal(again[hospital][split][1], first[hospital][split][1])


def test_unpadded_patient_ids_and_resizing(tmp_path):
    src = tmp_path / "src"
    written = write_camelyon(src, size=12, seed=1)
    folder = src / "camelyon17_v1.0"
    rows = read_metadata(folder)
    write_metadata(folder, [[r[0], str(int(r[1]))] + r[2:] for r in rows[1:]], header=rows[0])
    manifest = prepare_camelyon17(src, tmp_path / "out", size=5)
    assert manifest.image_size == (5, 5)
    expected = {load_image(path, 5).tobytes(): label for path, (_, label, _, _) in written.items()}
    count = 0
    for splits in read_shards(tmp_path / "out").values():
        for images, labels in splits.values():
            for image, label in zip(images, labels):
                assert expected[image.tobytes()] == label
                count += 1
    assert count == len(written)


def test_cli_prepare(tmp_path):
    src = tmp_path / "src"
    write_camelyon(src)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["prepare", "camelyon17", "--src", str(src), "--size", "8", "--data-root",
                                      str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"camelyon17: ready at {out / 'camelyon17'} (5 domains, 100 images)\n"
    assert "converted 100 images at 8x8 in" in result.stderr
    result = CliRunner().invoke(cli, ["prepare", "camelyon17", "--data-root", str(out / "x")])
    assert result.exit_code == 2 and "--src" in result.stderr and len(result.stderr.splitlines()) == 1


# ------------------------------------------------------------------ malformed sources


def _folder(src: Path) -> Path:
    return src / "camelyon17_v1.0"


def _edit(src: Path, line: int, column: str, value) -> None:
    rows = read_metadata(_folder(src))
    rows[line][rows[0].index(column)] = str(value)
    write_metadata(_folder(src), rows[1:], header=rows[0])


def break_no_metadata(src):
    (_folder(src) / "metadata.csv").unlink()
    return ("no metadata.csv", "camelyon17_v1.0")


def break_missing_patch(src):
    row = read_metadata(_folder(src))[5]
    patch = next(_folder(src).rglob(f"patch_patient_{int(row[1]):03d}_node_{row[2]}_x_{row[3]}_*"))
    patch.unlink()
    return ("metadata.csv line 6", patch.name, "not in")


def break_unreadable_patch(src):
    rows = read_metadata(_folder(src))
    last = rows[-1]  # the last hospital: earlier shards get written first
    patch = next(_folder(src).rglob(f"patch_patient_{int(last[1]):03d}_node_{last[2]}_x_{last[3]}_*"))
    patch.write_bytes(patch.read_bytes()[:40])
    return ("cannot read image", patch.name, "camelyon17_v1.0.tar.gz")


def break_bad_label(src):
    _edit(src, 3, "tumor", 2)
    return ("line 4", "tumor is '2'", "0 or 1")


def break_unknown_hospital(src):
    _edit(src, 7, "center", 5)
    return ("line 8", "center is '5'", "hospital 0..4")


def break_missing_column(src):
    rows = read_metadata(_folder(src))
    drop = rows[0].index("tumor")
    write_metadata(_folder(src), [r[:drop] + r[drop + 1:] for r in rows[1:]],
                   header=rows[0][:drop] + rows[0][drop + 1:])
    return ("no column 'tumor'",)


def break_short_row(src):
    rows = read_metadata(_folder(src))
    rows[9] = rows[9][:-2]
    write_metadata(_folder(src), rows[1:], header=rows[0])
    return ("line 10", "7 fields", "9")


def break_missing_hospital(src):
    rows = read_metadata(_folder(src))
    write_metadata(_folder(src), [r for r in rows[1:] if r[7] != "3"], header=rows[0])
    return ("no patch of hospital 3",)


def break_repeated_row(src):
    rows = read_metadata(_folder(src))
    write_metadata(_folder(src), rows[1:] + [rows[4]], header=rows[0])
    return ("repeats patch", f"line {len(rows) + 1}")


def break_no_patches_folder(src):
    shutil.rmtree(_folder(src) / "patches")
    return ("no patches/ folder",)


@pytest.mark.parametrize("damage", [break_no_metadata, break_missing_patch, break_unreadable_patch,
                                    break_bad_label, break_unknown_hospital, break_missing_column,
                                    break_short_row, break_missing_hospital, break_repeated_row,
                                    break_no_patches_folder])
def test_malformed_source_is_one_line_error_and_leaves_nothing(tmp_path, damage):
    src = tmp_path / "src"
    write_camelyon(src)
    words = damage(src)
    assert_refused_cleanly(lambda out: prepare_camelyon17(src, out, size=8), tmp_path / "out", words)


def test_no_src_and_two_candidate_folders(tmp_path):
    with pytest.raises(MpiflError) as excinfo:
        prepare_camelyon17(None, tmp_path / "out")
    assert_user_error(excinfo, "--src")
    src = tmp_path / "a"
    for name in ("first", "second"):
        write_camelyon(src)
        (src / "camelyon17_v1.0").rename(src / name)
    with pytest.raises(MpiflError) as excinfo:
        prepare_camelyon17(src, tmp_path / "out")
    assert_user_error(excinfo, "several folders", "first, second")
    assert_nothing_left(tmp_path / "out")
    # next to camelyon17_v1.0, other WILDS datasets' metadata.csv do not matter
    write_camelyon(src)
    (src / "iwildcam_v2.0").mkdir()
    (src / "iwildcam_v2.0" / "metadata.csv").write_text("x\n")
    assert prepare_camelyon17(src, tmp_path / "out", size=8).domains[0] == "hospital0"
