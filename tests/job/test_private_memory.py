"""``--private-memory``: a run whose clients' private state lives on disk between their rounds (budget 0), and
is checkpointed from there and resumed, computes what a run holding it all in memory computes."""

import pytest

from ..conftest import run_here
from ..rundir.test_checkpoint import numbers
from ..rundir.test_directory import one_error, snapshot

pytestmark = pytest.mark.slow

METHODS = {  # what each keeps: model-sized control variates; a whole personal model (evaluated for clients
    # that never trained); BN statistics adopted from round 2 on; BN layers plus kept momentum
    "scaffold": (), "singleset": (), "fixbn": ("--fixbn-stage-rounds", "1"),
    "fedbn": ("--keep-optimizer", "--momentum", "0.9")}


def _args(data_root, out, algo, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--algo", algo, "--threads", "1",
            "--clients-per-domain", "2", "--fraction", "0.3", "--samples-per-client", "32", "--out", str(out),
            *METHODS[algo], *extra]


@pytest.mark.parametrize("algo", sorted(METHODS))
def test_state_on_disk_checkpointed_and_resumed_gives_the_in_memory_numbers(data_root, tmp_path, algo):
    memory = run_here(*_args(data_root, tmp_path / "memory", algo, "--rounds", "3"))
    assert memory.returncode == 0, memory.stderr
    disk = tmp_path / "disk"
    first = run_here(*_args(data_root, disk, algo, "--rounds", "2", "--ckpt-every", "2", "--private-memory", "0"))
    assert first.returncode == 0, first.stderr
    resumed = run_here("--resume", str(disk), "--rounds", "3", "--private-memory", "0")
    assert resumed.returncode == 0, resumed.stderr
    trained = {c for r in numbers(disk)[:2] for c in r["clients"]}
    assert 0 < len(trained) < 10  # some clients had no state to checkpoint, and are created after the resume
    assert numbers(disk) == numbers(tmp_path / "memory")


@pytest.mark.parametrize("tmpdir", ["missing", "file"])
def test_a_spill_folder_that_cannot_be_used_is_refused_at_set_up_and_leaves_the_disk_untouched(data_root, tmp_path,
                                                                                            monkeypatch, tmpdir):
    where = tmp_path / tmpdir
    if tmpdir == "file":
        where.write_text("not a folder")
    monkeypatch.setenv("TMPDIR", str(where))
    before = snapshot(tmp_path)
    job = run_here(*_args(data_root, tmp_path / "run", "scaffold", "--rounds", "1", "--private-memory", "0"))
    assert job.returncode == 2
    problem = "does not exist" if tmpdir == "missing" else "is not a directory"
    one_error(job, "--private-memory 0 GiB: client rank 1's 10 clients' private state can outgrow it and would "
                   f"spill to TMPDIR={where}, which {problem}; point TMPDIR at a writable local disk")
    assert snapshot(tmp_path) == before  # no run directory: the same command, corrected, can run
    monkeypatch.delenv("TMPDIR")
    assert run_here(*_args(data_root, tmp_path / "run", "scaffold", "--rounds", "1", "--private-memory", "0")
                    ).returncode == 0
