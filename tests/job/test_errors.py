"""Bad input and failing ranks: one line naming the fix, non-zero exit, no hang."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mpifl.data.manifest import build_manifest
from mpifl.data.shard import ShardWriter
from mpifl.transport.gpu_mpi import cuda_aware

from ..conftest import launch, run_here, run_in_process

pytestmark = pytest.mark.slow


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--rounds", "2", "--threads", "1",
            *extra]


def _one_error_line(job, pattern: str) -> str:
    lines = job.lines("mpifl: error") + job.lines("mpifl: rank")
    assert len(lines) == 1, job.stdout + job.stderr
    assert pattern in lines[0], lines[0]
    assert "Traceback" not in job.stdout + job.stderr
    return lines[0]


@pytest.mark.parametrize("flag,value,pattern", [
    ("--algo", "fedsgd", "unknown algorithm 'fedsgd'"),
    ("--model", "vgg99", "unknown model 'vgg99'"),
    ("--data", "mnist-x", "mnist-x"),
    ("--device", "cuda", "no CUDA GPU is visible"),
    ("--lr", "-1", "--lr must be > 0"),
])
def test_bad_options_fail_once_on_three_ranks(data_root, tmp_path, flag, value, pattern):
    job = launch(3, *_args(data_root, tmp_path / "r", flag, value), timeout=60)
    assert job.returncode == 2
    _one_error_line(job, pattern)


@pytest.mark.parametrize("args,pattern", [
    (("--round", "2"), "mpifl: error: No such option '--round'"),
    (("--rounds", "2.5"), "mpifl: error: Invalid value for '--rounds': '2.5' is not a valid integer; see"),
])
def test_usage_errors_are_one_line_printed_once_on_three_ranks(args, pattern):
    job = launch(3, *args, timeout=60)
    assert job.returncode == 2
    assert (job.stdout + job.stderr).strip().splitlines() == [job.lines("mpifl: error")[0]], job.stderr
    assert job.lines("mpifl: error")[0].startswith(pattern)


def test_help_is_printed_once_on_three_ranks():
    job = launch(3, "--help", timeout=60)
    assert job.returncode == 0 and job.stdout.count("Usage:") == 1 and job.stdout.count("Show this message") == 1


@pytest.mark.skipif(cuda_aware() is not False, reason="needs an MPI library that says it is not CUDA-aware")
def test_gpu_buffers_on_an_mpi_without_cuda_support_are_refused(data_root, tmp_path):
    job = launch(3, *_args(data_root, tmp_path / "r", "--gpu-buffers", "device"), timeout=60)
    assert job.returncode == 2
    _one_error_line(job, "not CUDA-aware")


def test_one_mpi_rank_runs_the_server_and_a_client_host_in_process(data_root, tmp_path):
    job = launch(1, *_args(data_root, tmp_path / "r", "--rounds", "1", "--samples-per-client", "64"), timeout=120)
    assert job.returncode == 0, job.stderr
    assert "1 client ranks (in-process)" in (tmp_path / "r" / "log.txt").read_text()


@pytest.mark.parametrize("flag,value,pattern", [
    ("--lr", "-1", "--lr must be > 0"),
    ("--data", "mnist-x", "mnist-x"),  # found during set-up, by both threads
])
def test_bad_input_in_process_fails_once(data_root, tmp_path, flag, value, pattern):
    job = run_in_process(*_args(data_root, tmp_path / "r", flag, value), timeout=60)
    assert job.returncode == 2
    _one_error_line(job, pattern)


def _copy_data(data_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(data_root, root)
    return root


def test_missing_shard(data_root, tmp_path):
    root = _copy_data(data_root, tmp_path)
    (root / "styledigits" / "street.h5").unlink()
    job = launch(3, *_args(root, tmp_path / "r"), timeout=60)
    assert job.returncode == 2
    line = _one_error_line(job, "street.h5")
    assert "missing" in line


def test_a_manifest_domain_that_escapes_the_run_directory_is_refused(data_root, tmp_path):
    root = _copy_data(data_root, tmp_path)
    path = root / "styledigits" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["domains"][0] = escaping = "x/../../../ESCAPED"
    for key in ("splits", "shards"):
        manifest[key][escaping] = manifest[key].pop("mono")
    path.write_text(json.dumps(manifest))
    out = tmp_path / "a" / "b" / "out"
    job = run_here(*_args(root, out, "--holdout", "all"))
    assert job.returncode == 2
    _one_error_line(job, "domain 'x/../../../ESCAPED' is not a plain name")
    assert not list(tmp_path.rglob("*ESCAPED*")) and not (tmp_path / "a").exists()


def test_malformed_shard(data_root, tmp_path):
    root = _copy_data(data_root, tmp_path)
    shard = root / "styledigits" / "paper.h5"
    shard.write_bytes(b"not an hdf5 file" * 100)
    job = launch(3, *_args(root, tmp_path / "r"), timeout=60)
    assert job.returncode == 2
    _one_error_line(job, "paper.h5")


def test_a_data_root_that_is_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    for root, pattern in ((tmp_path / "file", "is a file, not a directory"),
                          (tmp_path / "file" / "below", "Not a directory")):
        job = run_here(*_args(root, tmp_path / "r"))
        assert job.returncode == 2
        _one_error_line(job, f"data root {root}")
        assert pattern in job.stderr and not (tmp_path / "r").exists()


def _toy(root, sizes: dict[str, tuple[int, int, int]]):
    """Dataset 'toy' of 8x8 images: domain -> (train, val, test) sizes."""
    rng = np.random.default_rng(0)
    for domain, counts in sizes.items():
        with ShardWriter(root / "toy" / f"{domain}.h5", dataset="toy", domain=domain, classes=["a", "b"],
                         image_size=(8, 8), channels=3, source="test") as writer:
            for split, n in zip(("train", "val", "test"), counts):
                writer.add(split, rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8), np.arange(n) % 2)
    build_manifest(root, "toy", source="test", protocol={}, normalize={"mean": [0.5] * 3, "std": [0.25] * 3})
    return root


@pytest.mark.parametrize("sizes,extra,pattern", [
    ({"one": (20, 0, 4), "two": (20, 4, 4)}, (), "domain one of toy has no val images"),
    ({"one": (20, 4, 4), "two": (20, 4, 0)}, (), "domain two of toy has no test images"),
    ({"one": (0, 4, 4), "two": (20, 4, 4)}, (), "domain one of toy has no training images; hold it out "
                                                "(--holdout one: it is then only evaluated)"),
    ({"one": (3, 4, 4), "two": (20, 4, 4)}, ("--clients-per-domain", "4"),
     "gets none of the domain's 3 training images, split among 4 clients"),
])
def test_a_domain_without_images_in_a_split_is_refused_at_set_up_naming_it(tmp_path, sizes, extra, pattern):
    job = run_here(*_args(_toy(tmp_path / "data", sizes), tmp_path / "r", "--data", "toy", *extra))
    assert job.returncode == 2
    _one_error_line(job, pattern)
    assert not (tmp_path / "r").exists()


def test_a_held_out_domain_needs_only_images(tmp_path):
    data = _toy(tmp_path / "data", {"one": (0, 0, 6), "two": (20, 4, 4)})
    job = run_here(*_args(data, tmp_path / "r", "--data", "toy", "--holdout", "one", "--rounds", "1"))
    assert job.returncode == 0, job.stderr
    assert "| one (held out) |" in (tmp_path / "r" / "summary.md").read_text()


def test_more_client_ranks_than_clients_warns_and_finishes(tmp_path):
    data = _toy(tmp_path / "data", {"one": (20, 4, 4)})
    job = launch(4, *_args(data, tmp_path / "r", "--data", "toy", "--rounds", "1"), timeout=180)
    assert job.returncode == 0, job.stderr
    warnings = job.lines("mpifl: warning")
    assert len(warnings) == 1 and "3 client ranks for 1 clients; ranks 2..3 stay idle" in warnings[0]


def test_nan_loss_names_client_and_round(data_root, tmp_path):
    job = launch(3, *_args(data_root, tmp_path / "r", "--rounds", "3", "--samples-per-client", "64"),
                 env={"MPIFL_FAULT": "nan:client=3,round=2"}, timeout=60)
    assert job.returncode != 0
    line = _one_error_line(job, "client 3")
    assert "round 2" in line and "nan" in line and "--lr" in line


def test_a_diverging_learning_rate_is_caught_as_nan(data_root, tmp_path):
    job = launch(2, *_args(data_root, tmp_path / "r", "--lr", "1e12", "--rounds", "2", "--samples-per-client", "64"),
                 timeout=60)
    assert job.returncode != 0
    _one_error_line(job, "lower --lr")


@pytest.mark.parametrize("fault", ["raise:rank=2,round=2", "exit:rank=1,round=1"])
def test_a_failing_rank_ends_the_job_promptly(data_root, tmp_path, fault):
    job = launch(3, *_args(data_root, tmp_path / "r", "--rounds", "50", "--samples-per-client", "64"),
                 env={"MPIFL_FAULT": fault}, timeout=60)
    assert job.returncode != 0
    assert job.seconds < 30
    if fault.startswith("raise"):
        line = _one_error_line(job, "rank 2 failed: RuntimeError: injected fault")
        assert "traceback in" in line
        assert list((tmp_path / "r").glob("traceback-rank2.txt"))


def test_holdout_with_a_personal_only_method_is_refused(data_root, tmp_path):
    job = launch(3, *_args(data_root, tmp_path / "r", "--algo", "fedbn", "--holdout", "street"), timeout=60)
    assert job.returncode == 2
    _one_error_line(job, "--holdout needs a method with a global model; fedbn evaluates personal models only")


def test_unknown_holdout_domain(data_root, tmp_path):
    job = launch(3, *_args(data_root, tmp_path / "r", "--holdout", "moon"), timeout=60)
    assert job.returncode == 2
    _one_error_line(job, "--holdout moon is not a domain of styledigits")


def test_missing_pretrained_checkpoint(data_root, tmp_path):
    job = launch(3, *_args(data_root, tmp_path / "r", "--pretrained", str(tmp_path / "none.pt")), timeout=60)
    assert job.returncode == 2
    _one_error_line(job, "none.pt")
