"""Per-benchmark layouts: split lists (PACS, DomainNet), split folders (VLCS), domain names, class sets."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from mpifl.data.__main__ import PREPARERS
from mpifl.data.benchmarks import (BENCHMARKS, DOMAINNET, DOMAINNET10, OFFICE_CALTECH, OFFICEHOME, PACS,
                                   VLCS, prepare_benchmark)
from mpifl.data.folders import convert_folders
from mpifl.data.manifest import DatasetManifest, verify
from mpifl.data.registry import KNOWN_DATASETS
from mpifl.data.shard import SPLITS, Shard
from mpifl.errors import MpiflError
from tests.data.test_folders import (PACS_DOMAINS, assert_nothing_left, assert_user_error, make_tree,
                                     pacs_tree, read_back)


def test_every_benchmark_is_registered():
    for name, spec in BENCHMARKS.items():
        assert name in PREPARERS and name in KNOWN_DATASETS
        assert spec.classes is not None or spec.num_classes
    assert {n: s.default_size for n, s in BENCHMARKS.items()} == {
        "pacs": 224, "office_caltech": 256, "officehome": 224, "vlcs": 224, "domainnet": 224,
        "domainnet10": 256}
    assert len(OFFICE_CALTECH.classes) == 10 and len(DOMAINNET10.classes) == 10 and len(PACS.classes) == 7
    with pytest.raises(MpiflError):
        prepare_benchmark("cifar10", "x", "y")


# ------------------------------------------------------------------ PACS split lists


def write_lists(directory: Path, template: str, lines_by_domain: dict) -> None:
    """``lines_by_domain``: domain -> split file key -> list of (relative path, label) lines."""
    directory.mkdir(parents=True, exist_ok=True)
    for domain, by_split in lines_by_domain.items():
        for key, lines in by_split.items():
            text = "".join(f"{path} {label}\n" for path, label in lines)
            (directory / template.format(domain=domain, split=key)).write_text(text)


def pacs_lists(src: Path, test_is_whole_domain: bool = False) -> dict:
    """PACS kfold lists over pacs_tree(per_class=10): train img000-006 (listed in reverse), crossval 007,
    test 008-009 (or the whole domain); return domain -> split -> expected paths in order."""
    expected, lines = {}, {}
    for domain in PACS_DOMAINS:
        test = range(10) if test_is_whole_domain else [8, 9]
        parts = {"train": range(6, -1, -1), "crossval": [7], "test": test}
        lines[domain] = {key: [(f"{domain}/{cls}/img{k:03d}.png", label)
                               for label, cls in enumerate(PACS.classes, 1) for k in ks]
                         for key, ks in parts.items()}
        expected[domain] = {split: [src / rel for rel, _ in lines[domain][key]]
                            for split, key in zip(SPLITS, ("train", "crossval", "test"))}
    write_lists(src / "pacs_label", "{domain}_{split}_kfold.txt", lines)
    return expected


def test_pacs_split_lists_are_honoured(tmp_path):
    src = tmp_path / "src"
    sources = pacs_tree(src)
    make_tree(src / "unlisted", {"photo": {"dog": 1}}, seed=7)[src / "unlisted/photo/dog/img000.png"]
    (src / "unlisted/photo/dog/img000.png").rename(src / "photo/dog/extra.png")  # on disk, in no list
    shutil.rmtree(src / "unlisted")
    expected = pacs_lists(src)
    manifest = convert_folders(PACS, src, tmp_path / "out", size=8)
    found = read_back(tmp_path / "out", "pacs", sources)
    assert found == expected  # list order kept, unlisted image left out
    assert manifest.protocol["split"].startswith("split lists (train <- {domain}_train_kfold.txt")
    assert "official PACS kfold lists" in manifest.protocol["split_origin"]
    assert "test_overlaps_train" not in manifest.protocol
    assert verify(tmp_path / "out", "pacs") == []


def test_pacs_official_test_list_covers_the_domain_and_is_flagged(tmp_path):
    src = tmp_path / "src"
    sources = pacs_tree(src)
    expected = pacs_lists(src, test_is_whole_domain=True)
    manifest = convert_folders(PACS, src, tmp_path / "out", size=8)
    assert read_back(tmp_path / "out", "pacs", sources) == expected
    assert manifest.protocol["test_overlaps_train"] is True
    assert "leave-one-domain-out" in manifest.protocol["note"]


def _edit_line(src, name, index, new):
    path = src / "pacs_label" / name
    lines = path.read_text().splitlines()
    lines[index] = new(lines[index])
    path.write_text("\n".join(lines) + "\n")


def bad_label_range(src):
    _edit_line(src, "cartoon_train_kfold.txt", 0, lambda l: l.rsplit(" ", 1)[0] + " 8")
    return ("cartoon_train_kfold.txt line 1", "label 8", "1..7")


def bad_label_count(src):
    for key in ("train", "crossval", "test"):
        path = src / "pacs_label" / f"photo_{key}_kfold.txt"
        path.write_text("".join(l + "\n" for l in path.read_text().splitlines() if "/person/" not in l))
    return ("photo", "use 6 labels", "7 classes", "person")


def bad_label_disagrees(src):
    _edit_line(src, "sketch_test_kfold.txt", 0, lambda l: l.rsplit(" ", 1)[0] + " 2")
    return ("sketch_test_kfold.txt line 1", "class 'dog' label 2")


def bad_missing_file(src):
    _edit_line(src, "art_painting_crossval_kfold.txt", 2, lambda l: "art_painting/giraffe/img099.png 3")
    return ("art_painting_crossval_kfold.txt line 3", "img099.png")


def bad_missing_list(src):
    (src / "pacs_label" / "sketch_test_kfold.txt").unlink()
    return ("sketch_test_kfold.txt", "missing")


def bad_line(src):
    _edit_line(src, "photo_test_kfold.txt", 1, lambda l: l.rsplit(" ", 1)[0])
    return ("photo_test_kfold.txt line 2",)


def bad_other_domain(src):
    _edit_line(src, "photo_test_kfold.txt", 1, lambda l: l.replace("photo/", "sketch/"))
    return ("photo_test_kfold.txt line 2", "sketch/")


@pytest.mark.parametrize("damage", [bad_label_range, bad_label_count, bad_label_disagrees, bad_missing_file,
                                    bad_missing_list, bad_line, bad_other_domain])
def test_pacs_bad_split_lists_are_one_line_errors(tmp_path, damage):
    src = tmp_path / "src"
    pacs_tree(src)
    pacs_lists(src)
    words = damage(src)
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(PACS, src, tmp_path / "out", size=8)
    assert_user_error(excinfo, *words)
    assert_nothing_left(tmp_path / "out")


# ------------------------------------------------------------------ DomainNet lists, 10-class subset


def domainnet_source(src: Path, classes, per_class=10, train=8, seed=0) -> dict:
    """A DomainNet-like tree with 0-based train/test lists (first ``train`` images train, rest test)."""
    domains = [d.id for d in DOMAINNET.domains]
    sources = make_tree(src, {d: {c: per_class for c in classes} for d in domains}, seed=seed)
    lines = {d: {key: [(f"{d}/{c}/img{k:03d}.png", label) for label, c in enumerate(sorted(classes))
                       for k in ks]
                 for key, ks in (("train", range(train)), ("test", range(train, per_class)))}
             for d in domains}
    write_lists(src, "{domain}_{split}.txt", lines)
    return sources


def test_domainnet_lists_give_train_and_test_and_val_is_carved_from_train(tmp_path):
    src = tmp_path / "src"
    sources = domainnet_source(src, ["apple", "bus", "cat"])
    spec = dataclasses.replace(DOMAINNET, num_classes=3)
    manifest = convert_folders(spec, src, tmp_path / "out", size=8)
    found = read_back(tmp_path / "out", "domainnet", sources)
    again = convert_folders(spec, src, tmp_path / "again", size=8)
    assert read_back(tmp_path / "again", "domainnet", sources) == found  # seeded val: deterministic
    for domain in manifest.domains:
        listed_train = [src / domain / c / f"img{k:03d}.png" for c in ("apple", "bus", "cat")
                        for k in range(8)]
        train, val, test = (found[domain][s] for s in SPLITS)
        assert test == [src / domain / c / f"img{k:03d}.png" for c in ("apple", "bus", "cat") for k in (8, 9)]
        assert sorted(train + val) == sorted(listed_train) and not set(train) & set(val)
        assert train == [p for p in listed_train if p in train]  # list order kept
        assert sorted(p.parent.name for p in val) == ["apple", "bus", "cat"]  # 10 % of 8 a class: 1
    assert "10 % of the train list" in manifest.protocol["split"]
    assert "official DomainNet" in manifest.protocol["split_origin"]
    assert again.protocol == manifest.protocol
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(DOMAINNET, src, tmp_path / "full", size=8)
    assert_user_error(excinfo, "found 3", "domainnet has 345")
    assert_nothing_left(tmp_path / "full")


def test_domainnet10_keeps_fedbn_classes_and_remaps_labels(tmp_path):
    src = tmp_path / "src"
    classes = list(DOMAINNET10.classes) + ["aircraft_carrier", "zigzag"]
    sources = domainnet_source(src, classes, per_class=3, train=2, seed=5)
    manifest = convert_folders(DOMAINNET10, src, tmp_path / "out", size=8)
    assert manifest.classes == list(DOMAINNET10.classes)
    found = read_back(tmp_path / "out", "domainnet10", sources)  # labels index the 10 classes
    for domain in manifest.domains:
        assert [p.name for p in found[domain]["test"]] == ["img002.png"] * 10
        assert {p.parent.name for s in SPLITS for p in found[domain][s]} == set(DOMAINNET10.classes)
        assert len(found[domain]["train"]) + len(found[domain]["val"]) == 20
    assert manifest.protocol["default_size"] == 256


def test_domainnet10_without_a_fedbn_class_is_an_error(tmp_path):
    src = tmp_path / "src"
    domainnet_source(src, list(DOMAINNET10.classes), per_class=2, train=1)
    shutil.rmtree(src / "quickdraw" / "whale")
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(DOMAINNET10, src, tmp_path / "out", size=8)
    assert_user_error(excinfo, "quickdraw", "whale")
    assert_nothing_left(tmp_path / "out")


# ------------------------------------------------------------------ Office-Caltech, Office-Home


def test_office_caltech_default_size_and_split(tmp_path):
    src = tmp_path / "src"
    folders = ("amazon", "Caltech", "dslr", "webcam")  # folder names match case-insensitively
    sources = make_tree(src, {d: {c: 5 for c in OFFICE_CALTECH.classes} for d in folders}, seed=2)
    (src / "dslr" / "mug" / "Thumbs.db").write_bytes(b"\0\1")
    manifest = convert_folders(OFFICE_CALTECH, src, tmp_path / "out")
    assert manifest.image_size == (256, 256) and manifest.domains == ["amazon", "caltech", "dslr", "webcam"]
    assert "72/8/20" in manifest.protocol["split"] and "FedBN" in manifest.protocol["split_origin"]
    for domain in manifest.domains:
        assert manifest.splits[domain] == {"train": 40, "val": 0, "test": 10}  # 5 a class: 4/0/1
    with Shard(tmp_path / "out" / "office_caltech" / "caltech.h5") as shard:
        images, labels = shard.load("test")
        assert images.shape == (10, 256, 256, 3) and sorted(labels) == list(range(10))
        assert "'Caltech'" in shard.source
    assert len(sources) == 200


def _labels_by_image(root, name: str, sources: dict) -> dict:
    """Source path -> the class name its shard row carries (every row must be one source image)."""
    manifest = DatasetManifest.load(root, name)
    by_bytes = {pixels.tobytes(): path for path, pixels in sources.items()}
    found = {}
    for domain in manifest.domains:
        with Shard(manifest.shard_path(root, domain)) as shard:
            for split in SPLITS:
                images, labels = shard.load(split)
                found.update({by_bytes[i.tobytes()]: manifest.classes[k] for i, k in zip(images, labels)})
    return found


def test_office_caltech_folder_name_variants_map_to_fedbn_names_and_are_logged_once(tmp_path):
    src = tmp_path / "src"
    usual = {c: c for c in OFFICE_CALTECH.classes}
    variants = {  # the shared copy's names, separators and case, Caltech-256's numbered folders
        "amazon": usual | {"back_pack": "backpack", "laptop_computer": "laptop"},
        "Caltech-10": usual | {"back_pack": "003.backpack", "laptop_computer": "127.laptop-101",
                               "mug": "041.coffee-mug", "headphones": "101.head-phones"},
        "DSLR": usual | {"back_pack": "Back-Pack", "laptop_computer": "Laptop Computer"},
        "webcam": usual | {"back_pack": "backpack", "laptop_computer": "laptop"}}
    layout = {d: {folder: 3 for folder in names.values()} for d, names in variants.items()}
    sources = make_tree(src, layout, seed=5)
    lines = []
    manifest = convert_folders(OFFICE_CALTECH, src, tmp_path / "out", size=8, log=lines.append)
    assert manifest.domains == ["amazon", "caltech", "dslr", "webcam"]
    assert manifest.classes == list(OFFICE_CALTECH.classes)
    canonical = {(d, folder): c for d, names in variants.items() for c, folder in names.items()}
    labels = _labels_by_image(tmp_path / "out", "office_caltech", sources)
    assert labels == {p: canonical[p.parent.parent.name, p.parent.name] for p in sources}
    mapped = [line for line in lines if "->" in line]
    assert mapped == ["office_caltech: domain folder 'Caltech-10' -> caltech",
                      "office_caltech: domain folder 'DSLR' -> dslr",
                      "office_caltech: class folder 'backpack' -> back_pack",
                      "office_caltech: class folder 'laptop' -> laptop_computer",
                      "office_caltech: class folder '003.backpack' -> back_pack",
                      "office_caltech: class folder '041.coffee-mug' -> mug",
                      "office_caltech: class folder '101.head-phones' -> headphones",
                      "office_caltech: class folder '127.laptop-101' -> laptop_computer",
                      "office_caltech: class folder 'Back-Pack' -> back_pack",
                      "office_caltech: class folder 'Laptop Computer' -> laptop_computer"]


def test_a_folder_name_matching_nothing_is_refused_with_the_accepted_names(tmp_path):
    src = tmp_path / "src"
    make_tree(src, {d: {c: 1 for c in OFFICE_CALTECH.classes} for d in ("amazon", "caltech", "dslr")}, seed=6)
    make_tree(src, {"webcam": {c: 1 for c in OFFICE_CALTECH.classes[1:] + ("rucksack",)}}, seed=7)
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(OFFICE_CALTECH, src, tmp_path / "out", size=8)
    assert_user_error(excinfo, "unknown class folder 'rucksack'", "domain webcam",
                      "laptop_computer (or laptop, laptop_101)", "'-', '_'")
    assert_nothing_left(tmp_path / "out")
    (src / "webcam" / "rucksack").rename(src / "webcam" / "back_pack")
    make_tree(src, {"webcam": {"Backpack": 1}}, seed=8)  # two folders of one class
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(OFFICE_CALTECH, src, tmp_path / "out", size=8)
    assert_user_error(excinfo, "two folders for class back_pack", "'Backpack'", "'back_pack'")
    shutil.rmtree(src / "webcam" / "Backpack")
    (src / "webcam").rename(src / "web-cams")
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(OFFICE_CALTECH, src, tmp_path / "out", size=8)
    assert_user_error(excinfo, "unknown domain folder 'web-cams'", "caltech (or caltech10, caltech256)")


def test_pacs_domain_and_class_variants_in_folders_and_lists(tmp_path):
    src = tmp_path / "src"
    sources = pacs_tree(src)
    expected = pacs_lists(src)  # the lists name art_painting/dog/...
    (src / "art_painting").rename(src / "Art-Painting")
    (src / "photo" / "dog").rename(src / "photo" / "Dog")
    sources = {Path(str(p).replace("art_painting", "Art-Painting").replace("photo/dog", "photo/Dog")): v
               for p, v in sources.items()}
    lines = []
    manifest = convert_folders(PACS, src, tmp_path / "out", size=8, log=lines.append)
    assert manifest.domains == list(PACS_DOMAINS) and manifest.classes == list(PACS.classes)
    assert "pacs: domain folder 'Art-Painting' -> art_painting" in lines
    assert "pacs: class folder 'Dog' -> dog" in lines
    labels = _labels_by_image(tmp_path / "out", "pacs", sources)
    assert {p: c for p, c in labels.items()} == {p: p.parent.name.lower() for p in sources}
    assert sum(manifest.splits["photo"].values()) == sum(len(v) for v in expected["photo"].values())


def test_discovered_class_spellings_are_one_class_named_as_most_domains_spell_it(tmp_path):
    src = tmp_path / "src"
    spelling = {"Art": "Alarm_Clock", "Clipart": "alarm clock", "Product": "Alarm_Clock",
                "Real World": "Alarm-Clock"}
    sources = make_tree(src, {f: {name: 2, "Backpack": 2} for f, name in spelling.items()}, seed=4)
    lines = []
    manifest = convert_folders(dataclasses.replace(OFFICEHOME, num_classes=2), src, tmp_path / "out", size=8,
                               log=lines.append)
    assert manifest.classes == ["Alarm_Clock", "Backpack"]
    labels = _labels_by_image(tmp_path / "out", "officehome", sources)
    assert {p: c for p, c in labels.items()} == {
        p: "Backpack" if p.parent.name == "Backpack" else "Alarm_Clock" for p in sources}
    assert [line for line in lines if "class folder" in line] == [
        "officehome: class folder 'alarm clock' -> Alarm_Clock",
        "officehome: class folder 'Alarm-Clock' -> Alarm_Clock"]


def test_a_spec_whose_names_clash_is_a_programming_error():
    with pytest.raises(ValueError, match="'Back-Pack' would match both"):
        dataclasses.replace(OFFICE_CALTECH, class_aliases={"bike": ("Back-Pack",)})


def test_officehome_real_world_folder_becomes_real_world(tmp_path):
    src = tmp_path / "src"
    folders = {"art": "Art", "clipart": "Clipart", "product": "Product", "real_world": "Real World"}
    sources = make_tree(src, {f: {c: 4 for c in ("Alarm_Clock", "Backpack", "Batteries")}
                              for f in folders.values()}, seed=3)
    spec = dataclasses.replace(OFFICEHOME, num_classes=3)
    manifest = convert_folders(spec, src, tmp_path / "out", size=8)
    assert manifest.domains == ["art", "clipart", "product", "real_world"]
    assert manifest.classes == ["Alarm_Clock", "Backpack", "Batteries"]
    read_back(tmp_path / "out", "officehome", sources, folder_of=folders)
    with Shard(tmp_path / "out" / "officehome" / "real_world.h5") as shard:
        assert shard.domain == "real_world" and "'Real World'" in shard.source
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(OFFICEHOME, src, tmp_path / "full", size=8)
    assert_user_error(excinfo, "found 3", "officehome has 65")


def test_discovered_class_missing_in_one_domain_is_an_error(tmp_path):
    src = tmp_path / "src"
    make_tree(src, {f: {c: 2 for c in ("a", "b", "c")} for f in ("Art", "Clipart", "Product", "Real World")})
    shutil.rmtree(src / "Product" / "b")
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(dataclasses.replace(OFFICEHOME, num_classes=3), src, tmp_path / "out", size=8)
    assert_user_error(excinfo, "domain product", "class 'b'")
    assert_nothing_left(tmp_path / "out")


# ------------------------------------------------------------------ VLCS layouts

VLCS_CLASSES = ("bird", "car", "chair", "dog", "person")


def test_vlcs_flat_layout_gets_a_seeded_split(tmp_path):
    src = tmp_path / "src"
    folders = {"caltech": "CALTECH", "labelme": "LABELME", "pascal": "PASCAL", "sun": "SUN"}
    sources = make_tree(src, {f: {c: 10 for c in VLCS_CLASSES} for f in folders.values()}, seed=4)
    manifest = convert_folders(VLCS, src, tmp_path / "out", size=8)
    read_back(tmp_path / "out", "vlcs", sources, folder_of=folders)
    assert all(manifest.splits[d] == {"train": 35, "val": 5, "test": 10} for d in folders)
    assert "70/10/20" in manifest.protocol["split"]


def vlcs_split_tree(src: Path, crossval: bool = True) -> tuple[dict, dict]:
    folders = {"caltech": "Caltech101", "labelme": "LabelMe", "pascal": "VOC2007", "sun": "SUN09"}
    counts = {"train": 10, "test": 2, "full": 1} | ({"crossval": 1} if crossval else {})
    sources = make_tree(src, {f"{f}/{part}": {c: n for c in VLCS_CLASSES}
                              for f in folders.values() for part, n in counts.items()}, seed=6)
    return folders, sources


def test_vlcs_split_folders_are_honoured(tmp_path):
    src = tmp_path / "src"
    folders, sources = vlcs_split_tree(src)
    manifest = convert_folders(VLCS, src, tmp_path / "out", size=8)
    found = read_back(tmp_path / "out", "vlcs", sources, folder_of=folders)
    for domain, folder in folders.items():
        for split, part in zip(SPLITS, ("train", "crossval", "test")):
            assert found[domain][split] == sorted(p for p in sources if p.parts[-4:-2] == (folder, part))
    assert manifest.protocol["split"] == "split folders (train/crossval/test)"


def test_vlcs_without_crossval_carves_val_from_train(tmp_path):
    src = tmp_path / "src"
    folders, sources = vlcs_split_tree(src, crossval=False)
    manifest = convert_folders(VLCS, src, tmp_path / "out", size=8)
    found = read_back(tmp_path / "out", "vlcs", sources, folder_of=folders)
    for domain, folder in folders.items():
        train_folder = sorted(p for p in sources if p.parts[-4:-2] == (folder, "train"))
        assert sorted(found[domain]["train"] + found[domain]["val"]) == train_folder
        assert len(found[domain]["val"]) == 5  # 1 of 10 per class
    assert "10 % of the train folder" in manifest.protocol["split"]


def test_vlcs_inconsistent_layouts_are_errors(tmp_path):
    src = tmp_path / "src"
    vlcs_split_tree(src)
    shutil.rmtree(src / "SUN09" / "test")
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(VLCS, src, tmp_path / "out", size=8)
    assert_user_error(excinfo, "SUN09", "train folder but no test folder")
    shutil.rmtree(src / "SUN09")
    make_tree(src, {"SUN09": {c: 3 for c in VLCS_CLASSES}})
    with pytest.raises(MpiflError) as excinfo:
        convert_folders(VLCS, src, tmp_path / "out", size=8)
    assert_user_error(excinfo, "split differently", "sun: seeded")
    assert_nothing_left(tmp_path / "out")


def test_manifest_round_trips_through_load(tmp_path):
    src = tmp_path / "src"
    pacs_tree(src, per_class=2)
    manifest = convert_folders(PACS, src, tmp_path / "out", size=8)
    assert DatasetManifest.load(tmp_path / "out", "pacs") == manifest
