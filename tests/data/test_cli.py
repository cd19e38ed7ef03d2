"""``python -m mpifl.data``: prepare / info / verify, and one-line errors with exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from click.testing import CliRunner

from mpifl.data.__main__ import cli
from mpifl.data.registry import KNOWN_DATASETS

REPO = Path(__file__).resolve().parents[2]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_user_error(result, *words):
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpifl: error: "), result.stderr
    for word in words:
        assert word in lines[0]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    result = invoke("prepare", "styledigits", "--data-root", root)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"styledigits: ready at {root / 'styledigits'} (5 domains, 5500 images)\n"
    return root


def test_info_describes_the_dataset(prepared):
    result = invoke("info", "styledigits", "--data-root", prepared)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "classes    10: 0 1 2 3 4 5 6 7 8 9" in lines
    assert "images     28x28x3 uint8" in lines
    assert "normalize  mean [0.5000, 0.5000, 0.5000]  std [0.5000, 0.5000, 0.5000]" in lines
    rows = {line.split()[0]: line.split()[1:] for line in lines[lines.index(next(
        line for line in lines if line.startswith("domain"))) + 1:]}
    assert set(rows) == {"mono", "outline", "paper", "street", "texture", "total"}
    assert rows["street"][:3] == ["800", "100", "200"]
    assert rows["total"][:3] == ["4000", "500", "1000"]
    size = (prepared / "styledigits" / "paper.h5").stat().st_size
    assert int(rows["paper"][3]) == size


def test_verify_ok_then_problem(prepared, tmp_path):
    result = invoke("verify", "styledigits", "--data-root", prepared)
    assert (result.exit_code, result.stdout) == (0, "ok\n")
    copy = tmp_path / "styledigits"
    copy.mkdir()
    for f in (prepared / "styledigits").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    with h5py.File(copy / "mono.h5", "r") as f:
        offset = f["test/images"].id.get_chunk_info(0).byte_offset
    with open(copy / "mono.h5", "r+b") as f:  # overwrite some pixels
        f.seek(offset + 500)
        f.write(b"\x07" * 50)
    result = invoke("verify", "styledigits", "--data-root", tmp_path)
    assert result.exit_code == 1
    assert "mono: sha256 mismatch" in result.stdout and "ok" not in result.stdout.split()


def test_prepare_is_idempotent(prepared):
    before = (prepared / "styledigits" / "manifest.json").stat().st_mtime_ns
    assert invoke("prepare", "styledigits", "--data-root", prepared).exit_code == 0
    assert (prepared / "styledigits" / "manifest.json").stat().st_mtime_ns == before



@pytest.mark.parametrize("command,old", [("prepare", "--out"), ("info", "--root"), ("verify", "--root")])
def test_the_old_spellings_of_the_data_root_still_work_and_say_so_once(prepared, tmp_path, monkeypatch, command,
                                                                      old):
    monkeypatch.setenv("MPIFL_DATA_ROOT", str(tmp_path))  # no dataset at the default root
    result = invoke(command, "styledigits", old, prepared, f"{old}={prepared}")
    assert result.exit_code == 0 and (str(prepared / "styledigits") in result.stdout or result.stdout == "ok\n")
    assert result.stderr == f"mpifl: notice: {old} is now --data-root (the old spelling still works)\n"
    assert invoke(command, "styledigits", "--data-root", prepared).stderr == ""
    shown = invoke(command, "--help").stdout
    assert "--data-root" in shown and old not in shown

def test_prepare_known_dataset_without_converter(tmp_path, monkeypatch):
    monkeypatch.setitem(KNOWN_DATASETS, "future_set", "a dataset named before its converter exists")
    result = invoke("prepare", "future_set", "--src", tmp_path, "--data-root", tmp_path)
    assert_user_error(result, "converter for 'future_set' is not available", str(tmp_path / "future_set"))


def test_prepare_unknown_dataset(tmp_path):
    assert_user_error(invoke("prepare", "mnist_typo", "--data-root", tmp_path), "unknown dataset 'mnist_typo'",
                      "styledigits")


def test_prepare_styledigits_takes_no_source(tmp_path):
    result = invoke("prepare", "styledigits", "--src", tmp_path, "--data-root", tmp_path)
    assert_user_error(result, "drop --src")
    assert list(tmp_path.iterdir()) == []


def test_info_and_verify_of_missing_dataset(tmp_path):
    for command in ("info", "verify"):
        result = invoke(command, "pacs", "--data-root", tmp_path)
        assert_user_error(result, f"dataset 'pacs' not found under {tmp_path}",
                          f"python -m mpifl.data prepare pacs --src DIR --data-root {tmp_path}")


@pytest.mark.slow
def test_module_entry_point_prints_one_line_error(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "mpifl.data", "info", "nosuch", "--data-root", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("mpifl: error: unknown dataset 'nosuch'")
    assert proc.stderr.count("\n") == 1


def test_verify_of_styledigits_not_yet_generated(tmp_path):
    result = invoke("verify", "styledigits", "--data-root", tmp_path)
    assert_user_error(result, f"run `python -m mpifl.data prepare styledigits --data-root {tmp_path}`")
    assert list(tmp_path.iterdir()) == []


def test_prepare_over_a_build_of_other_images_is_refused_naming_it_and_changes_nothing(tmp_path, monkeypatch):
    """Another --size is refused before converting; another source only once converted (its images decide), and
    the same build again, or --replace, goes through."""
    from mpifl.data import __main__ as main
    from mpifl.data.folders import convert_folders

    from .test_folders import make_tree, toy_spec

    converted = []

    def convert(src, out, size):
        converted.append(src)
        return convert_folders(toy_spec(), src, out, size)

    monkeypatch.setitem(main.PREPARERS, "toy", convert)
    first, second = tmp_path / "first", tmp_path / "second"
    make_tree(first, {"One": {"x": 3, "y": 3}, "Two B": {"x": 3, "y": 3}}, seed=1)
    make_tree(second, {"One": {"x": 3, "y": 3}, "Two B": {"x": 3, "y": 3}}, seed=2)
    root = tmp_path / "root"
    assert invoke("prepare", "toy", "--src", first, "--size", 8, "--data-root", root).exit_code == 0

    def files():
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    before = files()
    built = f"{root / 'toy'} holds a build of toy (8x8 px, from {first.resolve()}); this one "
    fix = ") would replace it, and runs checkpointed on it could no longer resume; pass another --data-root, or " \
          "--replace to replace it"
    assert_user_error(invoke("prepare", "toy", "--src", second, "--size", 6, "--data-root", root),
                      built + "(at 6x6 px" + fix)
    assert len(converted) == 1 and files() == before  # refused before converting
    assert_user_error(invoke("prepare", "toy", "--src", second, "--size", 8, "--data-root", root),
                      built + "(other shards of one, two_b (content sha256)" + fix)
    assert files() == before and sorted(p.name for p in root.iterdir()) == ["toy"]  # no staging left either
    assert invoke("prepare", "toy", "--src", first, "--data-root", root, "--size", 8).exit_code == 0  # the same
    result = invoke("prepare", "toy", "--src", second, "--size", 6, "--data-root", root, "--replace")
    assert result.exit_code == 0, result.output
    assert json.loads((root / "toy" / "manifest.json").read_text())["image_size"] == [6, 6]
