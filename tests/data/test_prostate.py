"""Multi-site prostate MRI converter on generated NIfTI volumes: kept slices, windowing, binary masks, resizing,
FedFA's split sizes, layout variants and one-line errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import nibabel
import numpy as np
import pytest
from PIL import Image

from mpifl.data import prostate
from mpifl.data.manifest import verify
from mpifl.data.prostate import CLASSES, SITES, Case, case_slices, prepare_prostate, split_slices
from mpifl.data.shard import SPLITS, Shard
from mpifl.errors import MpiflError
from tests.data.test_folders import assert_refused_cleanly, assert_user_error

SHAPE = (8, 8, 6)  # x, y, z
PROSTATE = (0, 1, 2, 4, 5)  # slices whose mask marks prostate; 0 and 5 are a volume's first and last
KEPT = (1, 2, 4)
CASES = {"BIDMC": 4, "HK": 3, "I2CVB": 5, "BMC": 2, "RUNMC": 3, "UCL": 2}
#: the release's folder names (ISBI = RUNMC, ISBI_1.5 = BMC, whose masks are *_Segmentation)
FOLDERS = {"BIDMC": "BIDMC", "HK": "HK", "I2CVB": "I2CVB", "BMC": "ISBI_1.5", "RUNMC": "ISBI", "UCL": "UCL"}


def save(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nibabel.save(nibabel.Nifti1Image(array, np.eye(4)), path)


def write_case(folder: Path, name: str, rng, shape=SHAPE, suffix="_segmentation", ext=".nii.gz") -> tuple:
    """A random volume and its mask (labels 1 and 2 on the PROSTATE slices); returns both arrays."""
    volume = rng.integers(0, 1000, shape).astype(np.int16)
    mask = np.zeros(shape, np.uint8)
    for z in PROSTATE:
        mask[2:6, 1:4, z] = 1 + z % 2
    save(folder / f"{name}{ext}", volume)
    save(folder / f"{name}{suffix}{ext}", mask)
    return volume, mask


def write_release(root: Path, cases=CASES, folders=FOLDERS, seed: int = 0) -> dict:
    """The SAML layout under ``root``; returns site -> [(volume, mask)] in case order."""
    rng = np.random.default_rng(seed)
    written = {}
    for site, count in cases.items():
        suffix = "_Segmentation" if site == "BMC" else "_segmentation"
        written[site] = [write_case(root / folders[site], f"Case{i:02d}", rng, suffix=suffix) for i in range(count)]
    return written


def windowed(volume: np.ndarray) -> np.ndarray:
    """FedFA's intensity scaling, written out: clip at the 99th percentile, min..percentile to 0..255, truncate."""
    top = np.quantile(volume, 0.99)
    clipped = np.where(volume > top, top, volume).astype(np.float64)
    return ((clipped - volume.min()) / (top - volume.min()) * 255).astype(np.uint8)


def expected_slices(volume, mask, size=None) -> list[tuple[np.ndarray, np.ndarray]]:
    pixels = windowed(volume)
    slices = [(pixels[:, :, k].T, (mask[:, :, k] >= 1).astype(np.uint8).T) for k in KEPT]
    if size is None:
        return slices
    resample = getattr(Image, "Resampling", Image)
    return [(np.asarray(Image.fromarray(np.ascontiguousarray(i)).resize((size, size), resample.BILINEAR)),
             np.asarray(Image.fromarray(np.ascontiguousarray(m)).resize((size, size), resample.NEAREST)))
            for i, m in slices]


def read_back(out: Path, site: str) -> dict:
    with Shard(out / "prostate" / f"{site}.h5") as shard:
        assert (shard.dataset, shard.domain, shard.classes, shard.task) == ("prostate", site, CLASSES, "segmentation")
        return {split: shard.load(split) for split in SPLITS}


def fedfa_sizes(n: int) -> list[int]:
    return [int(0.6 * n), int(0.2 * n), int(0.2 * n)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    src, out = tmp_path_factory.mktemp("prostate_src"), tmp_path_factory.mktemp("out")
    written = write_release(src)
    lines = []
    manifest = prepare_prostate(src, out, size=8, log=lines.append)
    return written, out, manifest, lines


def test_manifest_is_a_three_channel_segmentation_dataset_of_the_six_sites(converted):
    _, out, manifest, _ = converted
    assert manifest.task == "segmentation" and manifest.classes == ["background", "prostate"]
    assert manifest.domains == sorted(SITES) and manifest.channels == 3 and manifest.image_size == (8, 8)
    assert len(manifest.normalize["mean"]) == 3 and manifest.protocol["default_size"] == 384
    assert verify(out, "prostate") == []


def test_kept_slices_are_the_windowed_slices_with_prostate_and_masks_are_binary(converted):
    written, out, _, _ = converted
    for site in SITES:
        expected = {image.tobytes(): mask for volume, mask in written[site] for image, mask in expected_slices(volume, mask)}
        seen = []
        for images, masks in read_back(out, site).values():
            assert set(np.unique(masks)) <= {0, 1} and all(m.any() for m in masks)
            for image, mask in zip(images, masks):
                assert np.array_equal(mask, expected[image[..., 1].tobytes()])  # the slice is the middle channel
                seen.append(image.tobytes())
        assert len(seen) == len(set(seen)) == sum(fedfa_sizes(len(expected)))


def test_split_sizes_are_fedfas_per_site(converted):
    _, out, manifest, lines = converted
    for site, count in CASES.items():
        sizes = fedfa_sizes(len(KEPT) * count)
        assert [len(read_back(out, site)[s][0]) for s in SPLITS] == sizes
        assert manifest.splits[site] == dict(zip(SPLITS, sizes))
    mapped = [line for line in lines if " <- " in line]
    assert len(mapped) == len(SITES)
    assert any(line.startswith("prostate: BMC <- ") and line.endswith("ISBI_1.5 (2 cases, masks *_Segmentation.nii.gz)")
               for line in mapped), mapped
    assert any(line.startswith("prostate: RUNMC <- ") and line.endswith("ISBI (3 cases, masks *_segmentation.nii.gz)")
               for line in mapped), mapped


def test_split_of_the_reference_slice_counts_gives_fedrdn_table_6():
    # slices with prostate per site in the release (the lengths of HarmoFL's index files)
    counts = {"BIDMC": 261, "HK": 157, "I2CVB": 468, "BMC": 384, "RUNMC": 411, "UCL": 175}
    table6 = {"BIDMC": (156, 52, 52), "HK": (94, 31, 31), "I2CVB": (280, 93, 93), "BMC": (230, 76, 76),
              "RUNMC": (246, 82, 82), "UCL": (105, 35, 35)}
    for site, n in counts.items():
        parts = split_slices(n, site)
        assert tuple(len(p) for p in parts) == table6[site]
        assert len(np.unique(np.concatenate(parts))) == sum(table6[site])
        assert all(np.array_equal(a, b) for a, b in zip(parts, split_slices(n, site)))
    assert not np.array_equal(split_slices(100, "HK")[0], split_slices(100, "UCL")[0])


def test_layout_variants_and_resizing(tmp_path):
    src = tmp_path / "src" / "Processed_data_nii"
    folders = {"BIDMC": "bidmc", "HK": "Hk", "I2CVB": "i2cvb", "BMC": "isbi-1.5", "RUNMC": "Runmc", "UCL": "ucl"}
    rng = np.random.default_rng(1)
    written = {}
    for k, site in enumerate(SITES):
        suffix, ext = ("_seg", ".nii") if k % 2 else ("_SEGMENTATION", ".nii.gz")
        written[site] = [write_case(src / folders[site], case, rng, shape=(10, 7, 6), suffix=suffix, ext=ext)
                         for case in ("case07", "case08")]  # 6 slices: no split empty
    (src / "bidmc" / "README.txt").write_text("not a volume")  # other files are ignored,
    (src / "bidmc" / "._case07.nii.gz").write_bytes(b"\0")  # hidden ones (macOS resource forks) too
    manifest = prepare_prostate(tmp_path / "src", tmp_path / "out", size=5)
    assert manifest.image_size == (5, 5)
    for site in SITES:
        expected = [pair for case in written[site] for pair in expected_slices(*case, size=5)]
        got = read_back(tmp_path / "out", site)
        images = np.concatenate([got[s][0] for s in SPLITS])[..., 1]
        masks = np.concatenate([got[s][1] for s in SPLITS])
        pairs = {i.tobytes(): m for i, m in expected}
        assert len(images) == 5 and all(np.array_equal(pairs[i.tobytes()], m) for i, m in zip(images, masks))
        assert set(np.unique(masks)) <= {0, 1}


def test_default_size_is_the_releases_384(tmp_path):
    write_release(tmp_path / "src", cases=dict.fromkeys(SITES, 2))
    manifest = prepare_prostate(tmp_path / "src", tmp_path / "out")
    assert manifest.image_size == (384, 384) and manifest.splits["UCL"] == {"train": 3, "val": 1, "test": 1}


def test_the_three_channels_are_the_slice_and_its_neighbours_or_the_slice_alone(tmp_path, monkeypatch):
    volume, mask = write_case(tmp_path, "Case00", np.random.default_rng(2))
    case = Case("Case00", tmp_path / "Case00.nii.gz", tmp_path / "Case00_segmentation.nii.gz")
    images, masks = case_slices(case, 8)
    pixels = windowed(volume)
    assert images.shape == (3, 8, 8, 3) and masks.shape == (3, 8, 8)
    for image, k in zip(images, KEPT):
        assert all(np.array_equal(image[..., c], pixels[:, :, k - 1 + c].T) for c in range(3))
    monkeypatch.setattr(prostate, "STACK_NEIGHBOURS", False)
    alone, _ = case_slices(case, 8)
    assert alone.shape == (3, 8, 8, 1) and np.array_equal(alone[..., 0], images[..., 1])


# ------------------------------------------------------------------ bad sources


def _site(src: Path, site: str) -> Path:
    return src / FOLDERS[site]


def break_missing_site(src):
    shutil.rmtree(_site(src, "UCL"))
    return "no folder for site UCL", "ISBI_1.5 (BMC)", "BMC (or ISBI_1.5)"


def break_volume_without_mask(src):
    (_site(src, "HK") / "Case01_segmentation.nii.gz").unlink()
    return "volume", "Case01.nii.gz has no mask", "_Segmentation or _seg"


def break_mask_without_volume(src):
    (_site(src, "BMC") / "Case00.nii.gz").unlink()
    return "mask", "Case00_Segmentation.nii.gz has no volume Case00.nii.gz"


def break_shape_mismatch(src):
    save(_site(src, "I2CVB") / "Case01_segmentation.nii.gz", np.ones((8, 8, 5), np.uint8))
    return "Case01.nii.gz is 8x8x6 but its mask Case01_segmentation.nii.gz is 8x8x5"


def break_unreadable_volume(src):
    path = _site(src, "UCL") / "Case01.nii.gz"  # the last site: earlier shards are written, then removed
    data = path.read_bytes()
    path.write_bytes(data[:-20])  # the header reads, the voxels end early
    return "cannot read", "Case01.nii.gz", "EOFError", "liuquande.github.io/SAML"


def break_not_a_volume(src):
    save(_site(src, "BIDMC") / "Case00.nii.gz", np.ones((8, 8), np.int16))
    return "Case00.nii.gz holds an array of shape (8, 8)", "3-D volume"


def break_constant_volume(src):
    save(_site(src, "RUNMC") / "Case00.nii.gz", np.full(SHAPE, 7, np.int16))
    return "Case00.nii.gz has no intensity range"


def break_two_folders_for_a_site(src):
    shutil.copytree(_site(src, "RUNMC"), src / "RUNMC")
    return "folders", "both name site RUNMC"


def break_two_volumes_for_a_case(src):
    shutil.copy(_site(src, "HK") / "Case00.nii.gz", _site(src, "HK") / "case00.nii")
    return "two volumes of one case", "Case00.nii.gz and case00.nii", "keep one"


def break_empty_masks(src):
    for mask in _site(src, "HK").glob("*_segmentation.nii.gz"):
        save(mask, np.zeros(SHAPE, np.uint8))
    return "no slice of site HK", "has prostate in its mask"


def break_empty_site(src):
    for path in _site(src, "BIDMC").iterdir():
        path.unlink()
    return "no NIfTI volume", "site BIDMC"


def break_soft_mask(src):
    mask = np.zeros(SHAPE, np.float32)
    mask[2:6, 1:4, 1:5] = 0.4  # a soft (probability) mask: >= 1 nowhere, read as "no prostate" before
    save(_site(src, "HK") / "Case01_segmentation.nii.gz", mask)
    return "mask", "Case01_segmentation.nii.gz holds values that are not integer labels (e.g. 0.4"


def break_too_few_slices(src):
    for path in _site(src, "BIDMC").glob("Case01*"):
        path.unlink()
    return "site BIDMC", "has only 3 slices with prostate, so its val and test splits would be empty"


def break_dangling_volume(src):
    link = _site(src, "HK") / "Case07.nii.gz"
    link.symlink_to(src / "elsewhere" / "Case07.nii.gz")
    return "NIfTI file", str(link), "symbolic link that leads to", "which does not exist"


BREAKS = [break_dangling_volume, break_soft_mask, break_too_few_slices, break_missing_site, break_volume_without_mask,
          break_mask_without_volume, break_shape_mismatch,
          break_unreadable_volume, break_not_a_volume, break_constant_volume, break_two_folders_for_a_site,
          break_two_volumes_for_a_case, break_empty_masks, break_empty_site]


@pytest.mark.parametrize("damage", BREAKS, ids=[b.__name__[6:] for b in BREAKS])
def test_bad_source_is_one_line_and_leaves_nothing(tmp_path, damage):
    src = tmp_path / "src"
    write_release(src, cases=dict.fromkeys(SITES, 2))
    words = damage(src)
    assert_refused_cleanly(lambda out: prepare_prostate(src, out, size=8), tmp_path / "out", words)


def test_missing_src_names_what_it_must_hold(tmp_path):
    with pytest.raises(MpiflError) as excinfo:
        prepare_prostate(None, tmp_path / "out")
    assert_user_error(excinfo, "prostate is converted from a download", "--src", "site folders")
