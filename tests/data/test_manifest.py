"""manifest.json: building from shards, loading, verifying, open_shard, and the registry."""

import json
import shutil

import h5py
import numpy as np
import pytest

from mpifl.data import KNOWN_DATASETS, DatasetManifest, default_data_root, ensure_dataset, open_shard
from mpifl.data.manifest import MANIFEST, build_difference, build_manifest, build_of, sha256_file, verify
from mpifl.data.shard import ShardWriter
from mpifl.errors import MpiflError

CLASSES = ["a", "b", "c"]
SIZE = (4, 5)


def make_shard(root, name, domain, n_train, seed, classes=CLASSES, brightness=0):
    """A small shard with train images drawn around ``brightness``; returns the train images."""
    rng = np.random.default_rng(seed)
    x = rng.integers(brightness, brightness + 100, (n_train, *SIZE, 3), dtype=np.uint8)
    with ShardWriter(root / name / f"{domain}.h5", dataset=name, domain=domain, classes=classes,
                     image_size=SIZE, channels=3, source="test") as w:
        w.add("train", x, rng.integers(0, len(classes), n_train))
        w.add("val", x[:3], np.zeros(3, int))
        w.add("test", x[-5:], np.ones(5, int))
    return x


@pytest.fixture
def toy(tmp_path):
    """Dataset 'toy' with two domains of different size and brightness, and its manifest."""
    x_dark = make_shard(tmp_path, "toy", "dark", 30, seed=1, brightness=0)
    x_light = make_shard(tmp_path, "toy", "light", 10, seed=2, brightness=150)
    manifest = build_manifest(tmp_path, "toy", source="made in a test", protocol={"clients_per_domain": 2})
    return tmp_path, manifest, np.concatenate([x_dark, x_light])


def one_line(error):
    message = str(error.value)
    assert "\n" not in message
    return message


def test_build_manifest_describes_the_shards(toy):
    root, m, _ = toy
    assert m.name == "toy" and m.domains == ["dark", "light"] and m.classes == CLASSES
    assert m.num_classes == 3 and m.image_size == SIZE and m.channels == 3
    assert m.splits == {"dark": {"train": 30, "val": 3, "test": 5},
                        "light": {"train": 10, "val": 3, "test": 5}}
    assert m.split_sizes("light") == {"train": 10, "val": 3, "test": 5}
    assert m.protocol == {"clients_per_domain": 2} and m.source == "made in a test"
    path = root / "toy" / "dark.h5"
    with h5py.File(path, "r") as f:
        content = f.attrs["content_sha256"]
    assert m.shards["dark"] == {"file": "dark.h5", "sha256": sha256_file(path), "bytes": path.stat().st_size,
                                "content": content}
    assert m.shard_path(root, "light") == root / "toy" / "light.h5"


def test_default_normalization_is_pooled_over_domains(toy):
    _, m, train = toy
    pixels = train.reshape(-1, 3) / 255.0
    np.testing.assert_allclose(m.normalize["mean"], pixels.mean(axis=0), atol=1e-12)
    np.testing.assert_allclose(m.normalize["std"], pixels.std(axis=0), atol=1e-12)


def test_explicit_normalization_is_kept(tmp_path):
    make_shard(tmp_path, "toy", "dark", 6, seed=1)
    m = build_manifest(tmp_path, "toy", "s", {}, normalize={"mean": [0.5] * 3, "std": [0.25] * 3})
    assert m.normalize == {"mean": [0.5] * 3, "std": [0.25] * 3}


def test_write_and_load_round_trip(toy):
    root, m, _ = toy
    loaded = DatasetManifest.load(root, "toy")
    assert loaded == m
    assert isinstance(loaded.image_size, tuple)
    text = (root / "toy" / MANIFEST).read_text()
    assert text.startswith("{\n  ")  # pretty-printed
    assert [p.name for p in (root / "toy").iterdir() if "tmp" in p.name] == []


def test_build_rejects_shards_that_disagree(tmp_path):
    make_shard(tmp_path, "toy", "dark", 6, seed=1)
    make_shard(tmp_path, "toy", "odd", 6, seed=2, classes=["a", "b", "x"])
    with pytest.raises(MpiflError) as error:
        build_manifest(tmp_path, "toy", "s", {})
    assert "domain odd" in one_line(error)


def test_build_rejects_empty_directory(tmp_path):
    (tmp_path / "toy").mkdir()
    with pytest.raises(MpiflError, match="no shards"):
        build_manifest(tmp_path, "toy", "s", {})


def test_verify_passes_then_reports_a_tampered_byte(toy):
    root, m, _ = toy
    assert verify(root, "toy") == []
    path = root / "toy" / "light.h5"
    with h5py.File(path, "r") as f:  # flip one pixel inside the first train chunk
        offset = f["train/images"].id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems = verify(root, "toy")
    assert len(problems) == 1
    assert problems[0].startswith("light: sha256 mismatch")
    open_shard(root, m, "light").close()  # same length: the cheap check lets it through


def test_verify_reports_missing_and_unlisted_shards(toy):
    root, _, _ = toy
    (root / "toy" / "dark.h5").rename(root / "toy" / "extra.h5")
    problems = verify(root, "toy")
    assert problems[0].startswith("dark: shard missing")
    assert problems[-1] == "extra.h5: shard not listed in the manifest"


def test_verify_reports_shard_that_disagrees_with_manifest(toy):
    root, m, _ = toy
    m.splits["dark"]["train"] = 31
    m.write(root)
    assert verify(root, "toy") == ["dark: split sizes {'train': 30, 'val': 3, 'test': 5} but manifest "
                                   "says {'train': 31, 'val': 3, 'test': 5}"]


def test_open_shard_checks_agreement_with_manifest(toy):
    root, m, _ = toy
    with open_shard(root, m, "dark") as shard:
        assert shard.sizes == m.splits["dark"]
    m.splits["dark"]["val"] = 4
    with pytest.raises(MpiflError) as error:
        open_shard(root, m, "dark")
    assert "domain dark" in one_line(error) and "split sizes" in str(error.value)


def test_open_shard_rejects_changed_length(toy):
    root, m, _ = toy
    path = root / "toy" / "dark.h5"
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(MpiflError) as error:
        open_shard(root, m, "dark")
    assert str(path) in one_line(error) and "bytes" in str(error.value)


def test_open_shard_refuses_another_domains_shard_copied_over_it(tmp_path):
    """Same size, splits, classes and image shape (cp a.h5 b.h5): only the shard's own name tells, and opening
    checks it without reading the images."""
    make_shard(tmp_path, "twins", "a", 10, seed=1)
    make_shard(tmp_path, "twins", "b", 10, seed=2)
    m = build_manifest(tmp_path, "twins", source="made in a test", protocol={})
    shutil.copyfile(tmp_path / "twins" / "a.h5", tmp_path / "twins" / "b.h5")
    assert m.shards["a"]["bytes"] == m.shards["b"]["bytes"] == (tmp_path / "twins" / "b.h5").stat().st_size
    with pytest.raises(MpiflError) as error:
        open_shard(tmp_path, m, "b")
    assert one_line(error).startswith(f"shard {tmp_path / 'twins' / 'b.h5'} (domain b): it says it is dataset "
                                      "'twins' domain 'a'; run `python -m mpifl.data prepare twins")
    with open_shard(tmp_path, m, "a") as shard:
        assert shard.domain == "a"


def _another_build(tmp_path, name, seed_offset=0):
    """Dataset ``name`` under ``tmp_path/name``: domains dark and light with toy's counts and sizes, other pixels
    when ``seed_offset`` is not 0 (as from another source)."""
    root = tmp_path / name
    make_shard(root, "toy", "dark", 30, seed=1 + seed_offset)
    make_shard(root, "toy", "light", 10, seed=2, brightness=150)
    return root, build_manifest(root, "toy", source="made in a test", protocol={})


def test_open_shard_refuses_the_same_domain_from_another_build_copied_over_it(tmp_path):
    """Same name, counts, classes, shape and file length (cp B/toy/dark.h5 A/toy/dark.h5): the content checksum
    the shard carries, one attribute, tells it from the one the manifest was written with."""
    root, m = _another_build(tmp_path, "a")
    other, _ = _another_build(tmp_path, "b", seed_offset=10)
    shutil.copyfile(other / "toy" / "dark.h5", root / "toy" / "dark.h5")
    assert (root / "toy" / "dark.h5").stat().st_size == m.shards["dark"]["bytes"]
    with pytest.raises(MpiflError) as error:
        open_shard(root, m, "dark")
    assert one_line(error).startswith(f"shard {root / 'toy' / 'dark.h5'} (domain dark): it is not the shard this "
                                      "manifest was prepared with (content sha256 ")
    assert "another build's file copied over it; run `python -m mpifl.data prepare toy" in str(error.value)
    with open_shard(root, m, "light") as shard:  # the same build of light, from the other root: the same content
        assert shard.content == m.shards["light"]["content"]


def test_a_dataset_prepared_before_content_checksums_is_checked_by_its_files_sha256(tmp_path):
    """A manifest without content checksums (and shards without them, as an earlier mpifl wrote them) still
    opens; another build's shard copied over one is refused by its file's sha256, read once per process."""
    root, _ = _another_build(tmp_path, "a")
    other, _ = _another_build(tmp_path, "b", seed_offset=10)
    for shard in [*root.glob("toy/*.h5"), *other.glob("toy/*.h5")]:
        with h5py.File(shard, "a") as f:
            del f.attrs["content_sha256"]
    m = build_manifest(root, "toy", source="made in a test", protocol={})
    assert "content" not in m.shards["dark"] and "content" not in build_of(m)
    assert DatasetManifest.load(root, "toy") == m
    open_shard(root, m, "dark").close()
    shutil.copyfile(other / "toy" / "dark.h5", root / "toy" / "dark.h5")
    with pytest.raises(MpiflError) as error:
        open_shard(root, m, "dark")
    assert one_line(error).startswith(f"shard {root / 'toy' / 'dark.h5'} (domain dark): its sha256 differs from the "
                                      "manifest's: another build's file copied over it")


def test_a_build_is_told_from_another_by_its_image_size_and_shards_content(toy, tmp_path):
    _, m, _ = toy
    build = build_of(m)
    assert build == {"image_size": list(SIZE), "shards": {d: m.shards[d]["sha256"] for d in ("dark", "light")},
                     "content": {d: m.shards[d]["content"] for d in ("dark", "light")}}
    assert build_difference(build, json.loads(json.dumps(build))) is None  # as a checkpoint stores it
    assert build_difference(build, {**build, "image_size": [16, 16]}) == "images 4x5, now 16x16"
    changed = {**build, "content": {"dark": "0" * 64, "light": build["content"]["light"], "extra": "1" * 64}}
    assert build_difference(build, changed) == "other shards of dark, extra (content sha256)"
    rewritten = {**build, "shards": {d: "2" * 64 for d in build["shards"]}}  # the same images, another file
    assert build_difference(build, rewritten) is None
    _, other = _another_build(tmp_path, "b", seed_offset=10)
    assert build_difference(build_of(_another_build(tmp_path, "a")[1]), build_of(other)) == \
        "other shards of dark (content sha256)"
    old = {"image_size": list(SIZE), "shards": build["shards"]}  # a checkpoint of an earlier mpifl: files' sha256
    assert build_difference(old, build) is None
    assert build_difference(old, rewritten) == "other shards of dark, light (sha256)"


def test_open_shard_missing_file_says_how_to_prepare(toy):
    root, m, _ = toy
    path = root / "toy" / "light.h5"
    path.unlink()
    with pytest.raises(MpiflError) as error:
        open_shard(root, m, "light")
    assert one_line(error) == (f"shard missing: {path}; run `python -m mpifl.data prepare toy --src DIR "
                               f"--data-root {root}`")


def test_unknown_domain_lists_domains(toy):
    root, m, _ = toy
    with pytest.raises(MpiflError, match="choose from dark, light"):
        open_shard(root, m, "medium")


def test_load_missing_dataset_says_which_prepare_to_run(tmp_path):
    with pytest.raises(MpiflError) as error:
        DatasetManifest.load(tmp_path, "pacs")
    assert one_line(error) == (f"dataset 'pacs' not found under {tmp_path}; run `python -m mpifl.data "
                               f"prepare pacs --src DIR --data-root {tmp_path}`")


def rewrite(root, change, name="toy"):
    path = root / name / MANIFEST
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(extra=1), "unknown keys extra"),
    (lambda d: d.pop("shards"), "missing keys shards"),
    (lambda d: d.update(format_version=2), "format version 2"),
    (lambda d: d.update(name="other"), "name is 'other'"),
    (lambda d: d.update(image_size=[4]), "image_size"),
    (lambda d: d["splits"].pop("light"), "splits of domain light"),
    (lambda d: d["shards"]["dark"].pop("sha256"), "shards entry of domain dark"),
    (lambda d: d["normalize"].update(std=[0, 1, 1]), "normalize"),
])
def test_load_rejects_malformed_manifest(toy, change, words):
    root, _, _ = toy
    rewrite(root, change)
    with pytest.raises(MpiflError) as error:
        DatasetManifest.load(root, "toy")
    message = one_line(error)
    assert words in message and str(root / "toy" / MANIFEST) in message and "prepare toy" in message


def _rename_domain(data, old, new):
    data["domains"] = [new if d == old else d for d in data["domains"]]
    for key in ("splits", "shards"):
        data[key][new] = data[key].pop(old)


@pytest.mark.parametrize("change, words", [
    (lambda d: _rename_domain(d, "dark", "x/../../../ESCAPED"), "domain 'x/../../../ESCAPED' is not a plain name"),
    (lambda d: _rename_domain(d, "dark", ".hidden"), "domain '.hidden' is not a plain name"),
    (lambda d: _rename_domain(d, "dark", "dark\n"), "domain 'dark\\n' is not a plain name"),
    (lambda d: d["shards"]["dark"].update(file="../dark.h5"), "must name the file dark.h5, not '../dark.h5'"),
    (lambda d: d.update(classes=["a", "../b", "c"]), "class '../b' is not a plain name"),
    (lambda d: d.update(classes=["a", " b", "c"]), "class ' b' is not a plain name"),
])
def test_names_that_could_become_paths_are_refused_where_a_manifest_is_read(toy, change, words):
    root, _, _ = toy
    rewrite(root, change)
    with pytest.raises(MpiflError) as error:
        DatasetManifest.load(root, "toy")
    assert words in one_line(error)


@pytest.mark.parametrize("domain,classes", [("x/../../E", CLASSES), ("ok", ["a", "b/c", "d"])])
def test_names_that_could_become_paths_are_refused_where_a_converter_writes(tmp_path, domain, classes):
    with pytest.raises(MpiflError, match="is not a plain name"):
        ShardWriter(tmp_path / "toy" / "ok.h5", dataset="toy", domain=domain, classes=classes, image_size=SIZE,
                    channels=3, source="test")
    assert not (tmp_path / "toy").exists()  # refused before anything was written


def test_load_rejects_invalid_json(toy):
    root, _, _ = toy
    (root / "toy" / MANIFEST).write_text("{")
    with pytest.raises(MpiflError, match="not readable JSON"):
        DatasetManifest.load(root, "toy")


def test_registry_loads_a_prepared_directory_under_any_name(toy):
    root, m, _ = toy
    assert ensure_dataset(root, "toy") == m  # not a known name, but prepared
    (root / "toy").rename(root / "pacs")  # a known name whose converter is not written yet
    rewrite(root, lambda d: d.update(name="pacs"), name="pacs")
    assert ensure_dataset(root, "pacs").domains == ["dark", "light"]


def test_registry_errors(tmp_path):
    with pytest.raises(MpiflError) as error:
        ensure_dataset(tmp_path, "office_caltech")
    assert f"prepare office_caltech --src DIR --data-root {tmp_path}" in one_line(error)
    with pytest.raises(MpiflError) as error:
        ensure_dataset(tmp_path, "mnist_typo")
    message = one_line(error)
    assert "unknown dataset 'mnist_typo'" in message
    assert all(name in message for name in KNOWN_DATASETS)
    with pytest.raises(MpiflError, match="bad dataset name"):
        ensure_dataset(tmp_path, "../etc")


def test_known_datasets_cover_the_planned_converters():
    assert {"styledigits", "styleshapes", "pacs", "office_caltech", "officehome", "domainnet", "domainnet10", "vlcs",
            "digits", "cifar10", "cifar10c", "camelyon17", "isic2019", "fairface", "prostate"} == set(KNOWN_DATASETS)


def test_default_data_root(monkeypatch, tmp_path):
    monkeypatch.delenv("MPIFL_DATA_ROOT", raising=False)
    assert str(default_data_root()) == "datasets"
    monkeypatch.setenv("MPIFL_DATA_ROOT", str(tmp_path))
    assert default_data_root() == tmp_path


def test_the_manifest_carries_the_shards_task_and_refuses_a_mix(tmp_path):
    def shard(domain, task):
        labels = np.zeros((2, 4, 4), np.uint8) if task == "segmentation" else np.array([0, 1])
        with ShardWriter(tmp_path / "seg" / f"{domain}.h5", dataset="seg", domain=domain, classes=["bg", "fg"],
                         image_size=(4, 4), channels=1, source="t", task=task) as writer:
            writer.add("train", np.arange(32, dtype=np.uint8).reshape(2, 4, 4, 1), labels)

    shard("a", "segmentation")
    shard("b", "segmentation")
    assert build_manifest(tmp_path, "seg", source="t", protocol={}).task == "segmentation"
    assert DatasetManifest.load(tmp_path, "seg").task == "segmentation"
    shard("c", "classification")
    with pytest.raises(MpiflError, match="disagrees with a on classes, image size, channels or task"):
        build_manifest(tmp_path, "seg", source="t", protocol={})
