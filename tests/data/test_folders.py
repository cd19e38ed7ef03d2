"""The generic image-folder converter: exact read-back, seeded splits, resizing, atomic failure."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from mpifl.data.__main__ import cli
from mpifl.data.benchmarks import PACS
from mpifl.data.folders import Domain, FolderSpec, convert_folders
from mpifl.data.images import load_image
from mpifl.data.manifest import DatasetManifest, verify
from mpifl.data.shard import SPLITS, Shard
from mpifl.data.splits import SPLIT_SEED, stratified_split
from mpifl.data.staging import REPLACING
from mpifl.errors import MpiflError

PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")


# ------------------------------------------------------------------ helpers (also used by test_benchmarks)


def make_tree(root: Path, layout: dict, *, size=(8, 8), ext="png", seed=0) -> dict:
    """Write random-pixel images ``root/<folder>/<class>/img<k>.<ext>`` for ``layout`` folder -> class -> n.

    ``folder`` may hold a slash (``CALTECH/train``).  Returns path -> the RGB
    pixels Pillow decodes from the file (for PNG, exactly the pixels written).
    """
    rng = np.random.default_rng(seed)
    written = {}
    for folder, classes in layout.items():
        for cls, n in classes.items():
            directory = root / folder / cls
            directory.mkdir(parents=True, exist_ok=True)
            for k in range(n):
                path = directory / f"img{k:03d}.{ext}"
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(path, **({"quality": 95} if ext == "jpg" else {}))
                with Image.open(path) as im:
                    written[path] = np.asarray(im.convert("RGB"))
    return written


def pacs_tree(root: Path, per_class: int = 10, **kwargs) -> dict:
    return make_tree(root, {d: {c: per_class for c in PACS.classes} for d in PACS_DOMAINS}, **kwargs)


def read_back(root: Path, name: str, sources: dict, folder_of: dict | None = None) -> dict:
    """Check every shard row against ``sources`` (path -> pixels); return domain -> split -> [paths].

    Each row's pixels must be those of exactly one source file of the same
    domain, its label the index of that file's class folder in the manifest's
    (sorted) classes.  ``folder_of`` maps a domain id to its folder name when
    they differ.
    """
    manifest = DatasetManifest.load(root, name)
    assert manifest.classes == sorted(manifest.classes)
    by_bytes = {pixels.tobytes(): path for path, pixels in sources.items()}
    assert len(by_bytes) == len(sources), "fixture images must be unique"
    found = {}
    for domain in manifest.domains:
        folder = (folder_of or {}).get(domain, domain)
        found[domain] = {}
        with Shard(manifest.shard_path(root, domain)) as shard:
            assert (shard.dataset, shard.domain) == (name, domain)
            for split in SPLITS:
                images, labels = shard.load(split)
                paths = []
                for image, label in zip(images, labels):
                    path = by_bytes[image.tobytes()]
                    assert folder in path.parts
                    assert manifest.classes[label] == path.parent.name
                    paths.append(path)
                found[domain][split] = paths
    return found


def assert_user_error(excinfo, *words) -> None:
    message = str(excinfo.value)
    assert "\n" not in message
    for word in words:
        assert str(word) in message, message


def assert_nothing_left(out: Path) -> None:
    left = [p for p in out.rglob("*")] if out.exists() else []
    assert left == [], left


def assert_refused_cleanly(convert, out: Path, words) -> None:
    """``convert(out)`` fails with one line holding every one of ``words`` and leaves nothing under ``out``."""
    with pytest.raises(MpiflError) as excinfo:
        convert(out)
    assert_user_error(excinfo, *words)
    assert_nothing_left(out)


# ------------------------------------------------------------------ seeded split, read-back


@pytest.fixture(scope="module")
def pacs_seeded(tmp_path_factory):
    src = tmp_path_factory.mktemp("pacs_src")
    sources = pacs_tree(src)
    out = tmp_path_factory.mktemp("out")
    manifest = convert_folders(PACS, src, out, size=8)
    return src, out, sources, manifest


def test_seeded_split_reads_back_pixel_and_label_exact(pacs_seeded):
    src, out, sources, manifest = pacs_seeded
    assert manifest.domains == list(PACS_DOMAINS)
    assert manifest.classes == list(PACS.classes)
    assert manifest.image_size == (8, 8) and manifest.channels == 3
    found = read_back(out, "pacs", sources)
    for domain in PACS_DOMAINS:
        paths = [p for split in SPLITS for p in found[domain][split]]
        assert sorted(paths) == sorted(p for p in sources if p.parts[-3] == domain)  # covering, disjoint
        for split, per_class in zip(SPLITS, (7, 1, 2)):  # 10 images a class: 70/10/20
            rows = found[domain][split]
            assert rows == sorted(rows)  # written in class, then file order
            for cls in PACS.classes:
                assert sum(p.parent.name == cls for p in rows) == per_class
    assert verify(out, "pacs") == []


def test_seeded_split_is_recorded_in_protocol_and_source(pacs_seeded):
    src, out, _, manifest = pacs_seeded
    assert "70/10/20" in manifest.protocol["split"] and str(SPLIT_SEED) in manifest.protocol["split"]
    assert "mpifl choice" in manifest.protocol["split_origin"]
    assert manifest.protocol["default_size"] == 224
    assert "bilinear" in manifest.protocol["resize"]
    assert "test_overlaps_train" not in manifest.protocol
    assert str(src.resolve()) in manifest.source
    with Shard(out / "pacs" / "cartoon.h5") as shard:
        assert "'cartoon'" in shard.source and "70/10/20" in shard.source


def test_seeded_split_is_deterministic(pacs_seeded, tmp_path):
    src, out, _, _ = pacs_seeded
    again = convert_folders(PACS, src, tmp_path, size=8)
    for domain in again.domains:
        with Shard(out / "pacs" / f"{domain}.h5") as a, Shard(tmp_path / "pacs" / f"{domain}.h5") as b:
            for split in SPLITS:
                xa, ya = a.load(split)
                xb, yb = b.load(split)
                assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def test_stratified_split_properties():
    groups = {"a": list(range(50)), "b": list(range(100, 137)), "c": [200, 201, 202], "d": [300]}
    fractions = (0.7, 0.1, 0.2)
    parts = stratified_split(groups, fractions, ("toy", "dom"))
    assert parts == stratified_split(groups, fractions, ("toy", "dom"))  # deterministic
    everything = [x for part in parts for x in part]
    assert sorted(everything) == sorted(x for g in groups.values() for x in g)  # disjoint and covering
    expected = {"a": (35, 5, 10), "b": (26, 4, 7), "c": (2, 0, 1), "d": (1, 0, 0)}
    for name, counts in expected.items():
        assert tuple(sum(x in groups[name] for x in part) for part in parts) == counts
    # a group's split does not depend on the other groups, and the key changes it
    alone = stratified_split({"a": groups["a"]}, fractions, ("toy", "dom"))
    assert alone == [[x for x in part if x in groups["a"]] for part in parts]
    assert stratified_split({"a": groups["a"]}, fractions, ("toy", "other")) != alone
    # within a part, items keep their given order
    assert all(part == sorted(part) for part in parts)


# ------------------------------------------------------------------ conversion (decoding: test_images.py)


def toy_spec(**overrides) -> FolderSpec:
    args = dict(name="toy", title="toy", source="unit test", default_size=5,
                domains=(Domain("one", ("One",)), Domain("two_b", ("Two B",))), num_classes=2,
                fractions_origin="test")
    args.update(overrides)
    return FolderSpec(**args)


def test_conversion_resizes_to_square_and_reads_jpeg_exactly(tmp_path):
    src = tmp_path / "src"
    jpegs = make_tree(src, {"One": {"x": 4, "y": 4}}, size=(8, 8), ext="jpg", seed=3)
    odd = make_tree(src, {"Two B": {"x": 4, "y": 4}}, size=(11, 7), seed=4)
    manifest = convert_folders(toy_spec(), src, tmp_path / "out", size=8)
    assert manifest.image_size == (8, 8) and manifest.domains == ["one", "two_b"]
    read_back(tmp_path / "out", "toy", jpegs | {p: load_image(p, 8) for p in odd},
              folder_of={"one": "One", "two_b": "Two B"})
    small = convert_folders(toy_spec(), src, tmp_path / "small")  # default size 5
    assert small.image_size == (5, 5)
    with Shard(tmp_path / "small" / "toy" / "two_b.h5") as shard:
        images, _ = shard.load("train")
        assert images.shape[1:] == (5, 5, 3)
        assert "'Two B'" in shard.source


# ------------------------------------------------------------------ malformed sources: one line, nothing left


def break_missing_class(src):
    for p in (src / "cartoon" / "horse").iterdir():
        p.unlink()
    (src / "cartoon" / "horse").rmdir()
    return ("cartoon", "horse")


def break_empty_class(src):
    for p in (src / "photo" / "dog").iterdir():
        p.unlink()
    return ("photo", "dog", "empty")


def break_unknown_class(src):
    make_tree(src, {"sketch": {"zebra": 1}}, seed=9)
    return ("unknown class folder", "zebra", "sketch")


def break_unreadable_image(src):
    bad = src / "sketch" / "person" / "broken.jpg"  # the last domain: earlier shards get written first
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return ("cannot read image", bad)


def break_truncated_png(src):
    path = src / "photo" / "guitar" / "img001.png"
    path.write_bytes(path.read_bytes()[:60])
    return ("cannot read image", path)


def break_unknown_domain(src):
    make_tree(src, {"watercolour": {"dog": 1}}, seed=9)
    return ("unknown domain folder", "watercolour")


def break_missing_domain(src):
    import shutil
    shutil.rmtree(src / "photo")
    return ("no folder for domain", "photo")


def break_nested_folder(src):
    (src / "art_painting" / "dog" / "more").mkdir()
    return ("unexpected folder", "more")


def break_dangling_link(src):
    link = src / "photo" / "dog" / "gone.jpg"
    link.symlink_to(src / "nowhere.jpg")
    return ("image", link, "symbolic link that leads to", "which does not exist")


def break_looping_link(src):
    link = src / "cartoon" / "house" / "loop.JPG"
    link.symlink_to(link)
    return ("image", link, "symbolic link that loops")


@pytest.mark.parametrize("damage", [break_missing_class, break_empty_class, break_unknown_class,
                                    break_unreadable_image, break_truncated_png, break_unknown_domain,
                                    break_missing_domain, break_nested_folder, break_dangling_link,
                                    break_looping_link])
def test_malformed_source_is_one_line_error_and_leaves_nothing(tmp_path, damage):
    src = tmp_path / "src"
    pacs_tree(src, per_class=2)
    words = damage(src)
    assert_refused_cleanly(lambda out: convert_folders(PACS, src, out, size=8), tmp_path / "out", words)


def test_failure_keeps_an_existing_out_root_and_its_other_datasets(tmp_path):
    src = tmp_path / "src"
    pacs_tree(src, per_class=2)
    out = tmp_path / "out"
    (out / "other").mkdir(parents=True)
    (out / "other" / "keep.txt").write_text("x")
    break_unreadable_image(src)
    with pytest.raises(MpiflError):
        convert_folders(PACS, src, out, size=8)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["other", "other/keep.txt"]


def test_folders_without_images_in_src_are_ignored(tmp_path):
    src = tmp_path / "src"
    sources = pacs_tree(src, per_class=2)
    (src / "splits").mkdir()
    (src / "splits" / "README.txt").write_text("notes")
    (src / ".cache").mkdir()
    (src / "__MACOSX").mkdir()
    (src / "__MACOSX" / "junk.png").write_bytes(b"")
    (src / "sketch" / "dog" / "Thumbs.db").write_bytes(b"\0")
    (src / "sketch" / "dog" / ".hidden.png").write_bytes(b"\0")
    convert_folders(PACS, src, tmp_path / "out", size=8)
    found = read_back(tmp_path / "out", "pacs", sources)
    assert sum(len(v) for d in found.values() for v in d.values()) == len(sources)


def test_no_src_is_an_error():
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(PACS, None, "unused")
    assert_user_error(excinfo, "--src")


def test_reconverting_replaces_the_same_build_another_only_when_told_and_never_other_folders(tmp_path):
    src = tmp_path / "src"
    pacs_tree(src, per_class=2)
    out = tmp_path / "out"
    convert_folders(PACS, src, out, size=8)
    convert_folders(PACS, src, out, size=8)  # the same build again
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(PACS, src, out, size=4)
    assert_user_error(excinfo, "holds a build of pacs (8x8 px", "this one (images 8x8, now 4x4)", "--replace")
    assert DatasetManifest.load(out, "pacs").image_size == (8, 8) and sorted(p.name for p in out.iterdir()) == ["pacs"]
    token = REPLACING.set(True)  # prepare --replace
    try:
        manifest = convert_folders(PACS, src, out, size=4)
    finally:
        REPLACING.reset(token)
    assert manifest.image_size == (4, 4) and verify(out, "pacs") == []
    assert sorted(p.name for p in out.iterdir()) == ["pacs"]  # no temporary folder left
    (out / "pacs" / "notes.txt").write_text("mine")
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(PACS, src, out, size=8)
    assert_user_error(excinfo, "notes.txt", "--data-root")
    assert DatasetManifest.load(out, "pacs").image_size == (4, 4)
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(dataclasses.replace(PACS, name="src"), src, tmp_path, size=8)
    assert_user_error(excinfo, "would replace the source")


# ------------------------------------------------------------------ command line


def test_cli_prepare_reports_time_and_verifies(tmp_path):
    src = tmp_path / "src"
    pacs_tree(src, per_class=2)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["prepare", "pacs", "--src", str(src), "--size", "8", "--data-root", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"pacs: ready at {out / 'pacs'} (4 domains, 56 images)\n"
    assert "converted 56 images at 8x8 in" in result.stderr
    result = CliRunner().invoke(cli, ["verify", "pacs", "--data-root", str(out)])
    assert (result.exit_code, result.stdout) == (0, "ok\n")


def test_cli_error_is_one_line(tmp_path):
    src = tmp_path / "src"
    pacs_tree(src, per_class=1)
    break_unknown_domain(src)
    result = CliRunner().invoke(cli, ["prepare", "pacs", "--src", str(src), "--data-root", str(tmp_path / "out")])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpifl: error: unknown domain folder 'watercolour'")
    result = CliRunner().invoke(cli, ["prepare", "pacs", "--data-root", str(tmp_path / "out")])
    assert result.exit_code == 2 and "--src" in result.stderr
    assert_nothing_left(tmp_path / "out")
