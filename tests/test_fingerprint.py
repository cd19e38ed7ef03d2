"""launch/fingerprint.py: the same numbers give the same fingerprint, whatever the timings; one changed number or
tensor gives another."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import zipfile

import pytest
import torch

from .conftest import REPO, launch_script

SCRIPT = REPO / "launch" / "fingerprint.py"


@pytest.fixture(scope="module")
def fingerprint():
    return launch_script("fingerprint")


@pytest.mark.slow
def test_the_fingerprint_ignores_timings_and_sees_one_ulp_of_a_number_or_a_tensor(fingerprint, tmp_path):
    job = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "out"), "fedbn", "--with=--peer-timeout=30"],
                         capture_output=True, text=True)
    assert job.returncode == 0, job.stderr
    recorded = json.loads((tmp_path / "out" / "fingerprints.json").read_text())
    assert recorded["with"] == ["--peer-timeout=30"]  # what the runs had besides the fingerprint's own options
    (name, value), = recorded["algorithms"].items()
    run = tmp_path / "out" / "runs" / "fedbn"
    assert name == "fedbn" and fingerprint.fingerprint(run) == value
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()

    def rewrite(last: dict) -> str:
        metrics.write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")
        return fingerprint.fingerprint(run)

    record = json.loads(lines[-1])
    record["seconds"]["round"] *= 2  # another run of the same numbers
    record["memory"]["peak_rss"][0] += 4096
    assert rewrite(record) == value
    record["train"]["loss"] = math.nextafter(record["train"]["loss"], math.inf)  # one ulp
    assert rewrite(record) != value
    metrics.write_text("\n".join(lines) + "\n")
    (rank_file,) = (run / "checkpoint").rglob("rank-*.zip")  # a client's private BN statistics, one ulp moved
    with zipfile.ZipFile(rank_file) as archive:
        members = {member: archive.read(member) for member in archive.namelist()}
    member = next(m for m in members if m.startswith("client-"))
    state = torch.load(io.BytesIO(members[member]), weights_only=True)
    key = next(k for k in state if k.endswith("running_mean"))
    state[key][0] = torch.nextafter(state[key][0], torch.tensor(float("inf")))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    members[member] = buffer.getvalue()
    with zipfile.ZipFile(rank_file, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    assert fingerprint.fingerprint(run) != value


@pytest.mark.slow
def test_an_existing_folder_and_an_unknown_algorithm_are_refused(fingerprint, tmp_path, monkeypatch):
    for args, line in (([str(tmp_path)], f"fingerprint: {tmp_path} exists; pass a new folder"),
                       ([str(tmp_path / "x"), "fedfoo"], "fingerprint: unknown algorithm fedfoo; choose from ")):
        monkeypatch.setattr(sys, "argv", ["fingerprint.py", *args])
        with pytest.raises(SystemExit) as refused:
            fingerprint.main()
        assert refused.value.code.startswith(line)
    assert not (tmp_path / "x").exists()


def _refused(fingerprint, monkeypatch, *args) -> str:
    monkeypatch.setattr(sys, "argv", ["fingerprint.py", *map(str, args)])
    with pytest.raises(SystemExit) as refused:
        fingerprint.main()
    return refused.value.code


def _checkout(path, init: str = "", sitecustomize: str = ""):
    (path / "mpifl").mkdir(parents=True)
    (path / "mpifl" / "__init__.py").write_text(init)
    if sitecustomize:
        (path / "sitecustomize.py").write_text(sitecustomize)
    return path


@pytest.mark.parametrize("make,said", [
    (lambda p: p / "nowhere", "does not exist; pass a checkout of mpifl"),
    (lambda p: p.mkdir() or p, "holds no mpifl package (mpifl/__init__.py); pass a checkout of mpifl"),
    (lambda p: _checkout(p / "old", init="raise ImportError('half a checkout')"),
     "cannot import the mpifl of {code}: ImportError: half a checkout"),
    # its Python would take another mpifl first (here: this checkout's, imported as the interpreter starts)
    pytest.param(lambda p: _checkout(p / "old", sitecustomize=f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
                                                               "import mpifl\n"),
                 "its Python imports mpifl from " + str(REPO / "mpifl") + ", not from {code}/mpifl; the numbers would "
                 "not be", marks=pytest.mark.slow),  # a child that imports torch
])
def test_code_that_is_not_a_checkout_whose_numbers_it_would_give_is_refused_in_one_line(fingerprint, tmp_path,
                                                                                        monkeypatch, make, said):
    code = make(tmp_path / "code")
    line = _refused(fingerprint, monkeypatch, tmp_path / "out", "fedbn", "--code", code)
    assert line.startswith("fingerprint: ") and said.format(code=code) in line and "\n" not in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("words,said", [
    (["--with=--seed=1"], "--with --seed=1: --with takes only an option that cannot change the numbers: "
                          "--fold-threads, --private-memory, --round-timeout, --peer-timeout, --gpu-buffers"),
    (["--with=--threads=2"], "--with --threads=2: --with takes only an option that cannot change the numbers"),
    (["--with=--eval-batch-size=64"], "--with --eval-batch-size=64: --with takes only an option that cannot"),
    (["--with=3"], "--with 3: --with takes only an option"),
    (["--with=--fold-threads", "--with=-1"], "--with --fold-threads -1: --fold-threads must be >= 0"),
    (["--with=--round-timeout=abc"], "--with --round-timeout=abc: Invalid value for '--round-timeout'"),
])
def test_with_takes_only_an_option_that_cannot_change_the_numbers(fingerprint, tmp_path, monkeypatch, words, said):
    """Issue 48: ``--with=--seed=1`` ran every method with other numbers than its fingerprint claims."""
    line = _refused(fingerprint, monkeypatch, tmp_path / "out", "fedbn", *words)
    assert line == f"fingerprint: {said}" or line.startswith(f"fingerprint: {said}"), line
    assert "\n" not in line and not (tmp_path / "out").exists()


def test_every_resumable_option_is_either_taken_or_refused_by_with(fingerprint):
    """An option a resume may change, added to mpifl, is refused by --with until someone decides it is neutral."""
    from mpifl.plan.config import RESUMABLE

    assert sorted(fingerprint.NEUTRAL + fingerprint.CHANGING) == sorted(RESUMABLE)
