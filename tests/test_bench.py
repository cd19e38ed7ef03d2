import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from mpifl import bench
from mpifl.bench import fold_seconds, main, speedup_bound
from mpifl.errors import MpiflError

from .conftest import REPO

#: a fold case that takes milliseconds: two uploads of 10 kB on one core
FOLD = ["--case", "fold", "--fold-clients", "2", "--fold-mb", "0.01", "--fold-threads", "1", "--repeats", "1"]
CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("sizes, ranks, bound", [
    ([800] * 5, 2, 5 / 3), ([400] * 10, 2, 2.0), ([900, 100, 100], 2, 1100 / 900), ([400] * 10, 4, 10 / 3)])
def test_the_speedup_bound_is_the_largest_rank_load_with_one_rank_over_that_with_k(sizes, ranks, bound):
    assert speedup_bound(sizes, ranks) == pytest.approx(bound)


def test_fold_case_times_each_thread_count_and_finds_the_same_bits():
    result = fold_seconds(clients=3, megabytes=0.5, thread_counts=[1, 2, 3], repeats=1)
    assert [row["threads"] for row in result["rows"]] == [1, 2, 3] and all(row["same_bits"] for row in result["rows"])
    for row in result["rows"]:  # a repeat disturbed by other processes is redone, at most ten calls in all
        for name in ("all_at_once", "one_client_at_a_time"):
            assert len(row[name]["repeats"]) + row[name]["dropped"] <= 10


@pytest.mark.slow
def test_bench_runs_every_way_and_accounts_for_every_uploaded_byte(tmp_path, data_root):
    """With evaluation every round: the bare loop evaluates too, and the scores' bytes are accounted for."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mpifl.bench", "--data-root", str(data_root), "--model", "smallcnn",
         "--samples-per-client", "8", "--rounds", "2", "--repeats", "1", "--eval-every", "1",
         "--json-out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["workload"]["clients"] == 10 and result["scaling_from_1_rank"]["2_ranks"]["bound"] == 2.0
    assert result["images_per_second"]["bare"] == pytest.approx(80 / result["seconds_per_round"]["bare"])
    assert all(len(v) == 1 and v[0] > 0 for v in result["rounds_measured"].values())
    assert set(result["rounds_measured"]) == {"bare", "mpifl_1_ranks", "mpifl_2_ranks", "mpifl_in_process"}
    assert set(result["bytes_per_round"]) == {"1_ranks", "2_ranks", "in_process"}
    for ranks, wire in result["bytes_per_round"].items():
        assert wire["matches_manifest"], (ranks, wire)
    assert "as expected" in proc.stdout and "MISMATCH" not in proc.stdout
    assert set(result["ratio_to_placement_bound"]) == {"1_ranks", "2_ranks"}
    assert result["ratio_to_placement_bound"]["1_ranks"] == pytest.approx(result["ratio_mpifl_1_rank_to_bare"])
    placed = result["placed_bare_seconds_per_round"]
    assert placed["1_ranks"] == result["seconds_per_round"]["bare"] and placed["2_ranks"] > 0
    assert result["ratio_to_placement_bound"]["2_ranks"] == pytest.approx(
        result["seconds_per_round"]["mpifl_2_ranks"] / placed["2_ranks"])
    fold, with_fold = result["fold_seconds_one_core"], result["placed_training_plus_one_fold_seconds"]
    assert 0 < fold < result["seconds_per_round"]["bare"] and with_fold["1_ranks"] == placed["1_ranks"]
    assert with_fold["2_ranks"] > fold and result["ratio_to_placed_training_plus_one_fold"]["2_ranks"] == pytest.approx(
        result["seconds_per_round"]["mpifl_2_ranks"] / with_fold["2_ranks"])


@pytest.mark.slow
def test_many_clients_case_reports_time_and_every_ranks_peak_memory(tmp_path, data_root):
    out = tmp_path / "many.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mpifl.bench", "--case", "many-clients", "--data-root", str(data_root), "--model",
         "smallcnn", "--clients-per-domain", "4", "--samples-per-client", "8", "--algos", "scaffold",
         "--fractions", "0.1,0.5", "--rounds", "2", "--json-out", str(out)], capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [(r["algo"], r["clients_per_round"]) for r in runs] == [("scaffold", 2), ("scaffold", 10)]
    assert all(len(r["seconds_per_round"]) == 2 and len(r["peak_rss_bytes"]) == 3 and min(r["peak_rss_bytes"]) > 0
               for r in runs)
    assert runs[0]["rank0_peak_over_smallest_fraction"] == 1.0 and "scaffold   C = 0.5" in proc.stdout


def calls(monkeypatch, name: str) -> list:
    """The calls of ``mpifl.bench.<name>``, which still runs."""
    seen, real = [], getattr(bench, name)

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(bench, name, spy)
    return seen


def refused(result) -> str:
    """The one line of a refusal, which printed nothing else."""
    assert result.exit_code == 2 and result.stdout == "", (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpifl: error: "), result.stderr
    return lines[0]


def test_a_json_out_in_a_missing_folder_is_refused_before_anything_runs(tmp_path, monkeypatch):
    folds = calls(monkeypatch, "fold_seconds")
    line = refused(CliRunner().invoke(main, [*FOLD, "--json-out", str(tmp_path / "missing" / "b.json")]))
    assert f"the folder {tmp_path / 'missing'} does not exist; make it" in line and folds == []


def test_the_table_is_shown_before_the_write_and_a_failed_write_keeps_the_results_on_screen(tmp_path, monkeypatch):
    """The folder gone while the benchmark ran: the table, then the results' JSON on one line, then what failed."""
    folder = tmp_path / "w"
    folder.mkdir()
    fold = bench.fold_seconds
    monkeypatch.setattr(bench, "fold_seconds", lambda *args: (fold(*args), folder.rmdir())[0])
    result = CliRunner().invoke(main, [*FOLD, "--json-out", str(folder / "b.json")])
    assert result.exit_code == 2, result.output
    table = result.stdout.splitlines()
    assert table[0].startswith("fold of 2 x 0.01 MB") and table[1].startswith("    1 thread(s): all at once")
    assert [row["threads"] for row in json.loads(table[2])["rows"]] == [1] and len(table) == 3
    assert result.stderr == (f"mpifl: error: results not written to {folder / 'b.json'} (No such file or directory); "
                             "the table and the JSON line above hold them: save that line, then free the disk or fix "
                             "the folder\n")


def test_a_write_that_fills_the_disk_leaves_no_partial_file(tmp_path, monkeypatch):
    fdopen = os.fdopen

    class Full:
        """A file on a disk that fills after 10 bytes."""

        def __init__(self, fd, mode):
            self.file = fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, text):
            self.file.write(text[:10])
            self.file.flush()
            if text[10:]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(bench.os, "fdopen", Full)
    result = CliRunner().invoke(main, [*FOLD, "--json-out", str(tmp_path / "b.json")])
    assert result.exit_code == 2 and "(No space left on device)" in result.stderr, result.output
    assert json.loads(result.stdout.splitlines()[-1])["clients"] == 2 and list(tmp_path.iterdir()) == []


def test_results_go_to_a_new_file_under_runs_bench_and_never_over_another(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "stamp", lambda: "20250102-030405", raising=False)
    (tmp_path / "bench.json").write_text("the old default's file")
    said = [CliRunner().invoke(main, FOLD).stdout.splitlines()[-1] for _ in range(3)]
    names = ["fold-20250102-030405.json", "fold-20250102-030405_1.json", "fold-20250102-030405_2.json"]
    assert said == [f"results written to runs/bench/{name}" for name in names]
    assert sorted(p.name for p in (tmp_path / "runs" / "bench").iterdir()) == names
    assert all(json.loads((tmp_path / "runs" / "bench" / name).read_text())["clients"] == 2 for name in names)
    assert (tmp_path / "bench.json").read_text() == "the old default's file"


def test_an_existing_json_out_is_refused_before_anything_runs(tmp_path, monkeypatch):
    folds = calls(monkeypatch, "fold_seconds")
    (tmp_path / "b.json").write_text("earlier results")
    line = refused(CliRunner().invoke(main, [*FOLD, "--json-out", str(tmp_path / "b.json")]))
    assert "exists; results are never overwritten" in line and folds == []
    assert (tmp_path / "b.json").read_text() == "earlier results"


def test_a_json_out_folder_gets_a_new_file_and_a_name_taken_meanwhile_the_next_free_one(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "stamp", lambda: "20250102-030405", raising=False)
    assert CliRunner().invoke(main, [*FOLD, "--json-out", str(tmp_path)]).stdout.splitlines()[-1] == (
        f"results written to {tmp_path / 'fold-20250102-030405.json'}")
    (tmp_path / "b.json").write_text("another process's")  # made after the check, before the write
    bench.publish(["the table"], {"seconds": 1.0}, bench.ResultFile(tmp_path / "b.json"))
    assert (tmp_path / "b.json").read_text() == "another process's"
    assert json.loads((tmp_path / "b_1.json").read_text()) == {"seconds": 1.0}


def test_a_checkout_stays_clean_after_the_benchmark(tmp_path, monkeypatch):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    for args in (["init", "-q"], ["add", ".gitignore"], ["commit", "-qm", "a checkout"]):
        subprocess.run([*git, *args], cwd=tmp_path, check=True)
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(main, FOLD).exit_code == 0
    assert subprocess.run([*git, "status", "--porcelain"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout == ""


@pytest.fixture
def nothing_runs(monkeypatch):
    """Any part of the benchmark that starts fails the test."""
    for name in ("fold_seconds", "bare_round_seconds", "placed_bare_rounds", "simulator_rounds", "many_clients"):
        monkeypatch.setattr(bench, name, lambda *args, name=name, **kwargs: pytest.fail(f"{name} ran"))


@pytest.mark.parametrize("args, says", [
    (["--fold-threads", "0,abc"], "--fold-threads 0,abc: 'abc' is not a whole number; give a comma list of thread "
                                  f"counts from 1 to {CORES}"),
    (["--fold-threads", "1,,2"], "--fold-threads 1,,2: '' is not a whole number"),
    (["--fold-threads", "-1"], "'-1' is out of range"),
    (["--fold-threads", str(CORES + 1)], f"'{CORES + 1}' is out of range"),
    (["--fold-mb", "nan"], "--fold-mb must be a finite number of at least 4e-06 (one float32), got nan"),
    (["--fold-mb", "inf"], "--fold-mb must be a finite number"),
    (["--fold-mb", "-1"], "--fold-mb must be a finite number"),
    (["--fold-mb", "1e-7"], "--fold-mb must be a finite number"),
    (["--fold-mb", "1e12"], "GB of memory"),
    (["--fold-clients", "0"], "--fold-clients must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--rounds", "3"], "--case fold does not read --rounds; drop it"),
    (["--json-out", ""], "--json-out is empty"),
])
def test_every_fold_option_is_checked_in_one_line_before_anything_runs(nothing_runs, args, says):
    assert says in refused(CliRunner().invoke(main, [*FOLD, *args]))


@pytest.mark.parametrize("args, says", [
    (["--client-ranks", "0"], "--client-ranks 0: '0' is out of range; give a comma list of client-rank counts"),
    (["--client-ranks", "1,abc"], "--client-ranks 1,abc: 'abc' is not a whole number"),
    (["--client-ranks", "11"], "more client ranks than the 10 clients of styledigits"),
    (["--fold-threads", "1,2"], "--fold-threads 1,2: 2 values; --case cross-silo passes mpifl.run one count"),
    (["--fold-threads", "abc"], "'abc' is not a whole number"),
    (["--rounds", "1"], "--rounds must be >= 2"),
    (["--rounds", "-3"], "--rounds must be >= 2"),
    (["--rounds", "abc"], "Invalid value for '--rounds': 'abc' is not a valid integer; see `python -m mpifl.bench"),
    (["--repeats", "-1"], "--repeats must be >= 1"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--local-epochs", "0"], "--local-epochs must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--clients-per-domain", "0"], "--clients-per-domain must be >= 1"),
    (["--samples-per-client", "-1"], "--samples-per-client must be >= 0"),
    (["--threads", "-1"], "--threads must be >= 0"),
    (["--eval-every", "-1"], "--eval-every must be >= 0"),
    (["--algo", "bogus"], "unknown algorithm 'bogus'"),
    (["--model", "bogus"], "unknown model 'bogus'"),
    (["--data", "bogus"], "unknown dataset 'bogus'"),
    (["--mpirun", "/nonexistent/mpirun -n"], "/nonexistent/mpirun is not a program found here"),
    (["--mpirun", "mpirun 'x"], "No closing quotation"),
    (["--fractions", "0.5"], "--case cross-silo does not read --fractions"),
    (["--compare", "--dp-clip -1 --dp-noise 1"], "--dp-clip must be > 0"),
    (["--compare", "--dp-clip 'x"], "No closing quotation"),
    (["--case", "many-clients", "--client-ranks", "1,2"], "2 values; --case many-clients runs with one count"),
    (["--case", "many-clients", "--algos", "fedavg,bogus"], "--algos fedavg,bogus: 'bogus' is not a method"),
    (["--case", "many-clients", "--fractions", "0.1,nan"], "'nan' is not in (0, 1]"),
    (["--case", "many-clients", "--fractions", "inf"], "'inf' is not in (0, 1]"),
    (["--case", "many-clients", "--fractions", "0"], "'0' is not in (0, 1]"),
    (["--case", "many-clients", "--fractions", "1.5"], "'1.5' is not in (0, 1]"),
    (["--case", "many-clients", "--fractions", "0.1,x"], "'x' is not a number"),
    (["--case", "many-clients", "--private-memory", "nan"], "--private-memory must be a finite number"),
    (["--case", "many-clients", "--repeats", "3"], "--case many-clients does not read --repeats"),
    (["--case", "many-clients", "--clients-per-domain", "1", "--client-ranks", "6"], "more client ranks than the 5"),
    (["--secagg-bits", "32"], "--case cross-silo does not read --secagg-bits"),
    (["--case", "secagg", "--fractions", "0.5"], "--case secagg does not read --fractions"),
    (["--case", "secagg", "--secagg-bits", "8"], "--secagg-bits must be in [16, 64], got 8"),
    (["--case", "secagg", "--algo", "fedproto"], "--secure-aggregation: fedproto's server rule needs rank 0 to see"),
    (["--case", "secagg", "--client-ranks", "1,11"], "more client ranks than the 10 clients of styledigits"),
    pytest.param(["--device", "cuda"], "no CUDA GPU is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")),
])
def test_every_option_of_the_runs_is_checked_in_one_line_before_anything_runs(nothing_runs, data_root, tmp_path,
                                                                               monkeypatch, args, says):
    """Refused with nothing written: no runs/bench folder either."""
    monkeypatch.chdir(tmp_path)
    assert says in refused(CliRunner().invoke(main, ["--data-root", str(data_root), *args]))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(CORES < 2, reason="folds on two cores")
def test_the_fold_table_shows_a_count_whose_reference_was_disturbed_throughout(tmp_path, monkeypatch):
    """Every repeat on the first count disturbed, the second's not: no ratio to the first for it, no crash."""
    undisturbed, calls = bench.undisturbed_seconds, iter(range(1000))  # a repeat: 1 core's two ways, then 2 cores'
    monkeypatch.setattr(bench, "undisturbed_seconds", lambda run, tries=10:
                        undisturbed(run, tries) if next(calls) % 4 >= 2 else (None, tries))
    result = CliRunner().invoke(main, [*FOLD, "--fold-threads", "1,2", "--json-out", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    table = result.stdout.splitlines()
    assert table[1] == ("    1 thread(s): all at once: every repeat disturbed   one client at a time: every repeat "
                        "disturbed")
    assert table[2].startswith("    2 thread(s): all at once ") and "x" not in table[2].split("(")[1].split(";")[0]


def test_a_failed_run_of_mpifl_is_one_line_with_its_own_last_line(monkeypatch, tmp_path):
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kwargs: subprocess.CompletedProcess(
        cmd, 2, "", "a warning\nmpifl: error: --lr must be > 0\n"))
    with pytest.raises(MpiflError) as failed:
        bench.simulator_rounds(None, "data", "styledigits", "digitmodel", 2, 1, 32, -1.0, 1, 1, 0, "cpu", tmp_path)
    assert str(failed.value) == ("the benchmark's run of mpifl.run in one process failed (exit 2): mpifl: error: --lr "
                                 "must be > 0")


def test_the_runs_are_checked_as_mpifl_run_makes_them_model_auto_resolved(data_root):
    """The session the bare loop trains is mpifl.run's for the same options (``--model auto`` was a traceback)."""
    session = bench.checked_session(bench.run_arguments(str(data_root), "styledigits", "auto", 2, 1, 32, 0.01, 1, 2, 8,
                                                        "cpu"), 2)
    assert session.cfg.model == "digitmodel" and len(session.clients) == 10
    assert [c.num_train for c in session.clients] == [8] * 10


def test_tracking_is_summed_per_round_and_set_against_an_untracked_round():
    rounds = [{"seconds": {"round": s}} for s in (2.0, 2.2, 2.1)]
    costs = [{"round loop": 1e-4, "mlflow": 0.008, "tensorboard": 0.0005},
             {"round loop": 3e-4, "mlflow": 0.010, "tensorboard": 0.0007}, None]  # None: a run whose log has none
    summary = bench.tracking_summary(rounds, costs, untracked=2.0)
    assert summary["seconds_per_round"] == 2.1 and summary["ratio_to_untracked"] == pytest.approx(1.05)
    assert summary["cpu"] == pytest.approx({"round loop": 2e-4, "mlflow": 0.009, "tensorboard": 0.0006})
    assert summary["share_of_round"] == pytest.approx((2e-4 + 0.009 + 0.0006) / 2.0)


def test_compared_runs_are_set_against_the_plain_ones_median_and_fastest():
    from mpifl.bench import SPLIT, compared_summary

    def rounds(*seconds):  # two client ranks: one computes and evaluates 30 % and 50 % of each round
        return [{"seconds": {"round": s, **{f: s / 10 for f in SPLIT}},
                 "rank_seconds": {"compute": [0.2 * s, 0.5 * s], "evaluation": [0.1 * s, 0.0]}} for s in seconds]

    summary = compared_summary(rounds(2.2, 2.0, 3.0), rounds(2.0, 1.0, 4.0))
    assert summary["seconds_per_round"] == 2.2 and summary["ratio_to_plain"] == pytest.approx(1.1)
    assert summary["ratio_of_fastest_rounds"] == 2.0 and summary["split"]["compute"] == pytest.approx(0.22)
    assert summary["client_idle_share"] == pytest.approx([0.7, 0.5])  # idle: neither computing nor evaluating


def test_the_dp_sgd_case_times_mpifl_and_a_bare_opacus_loop_on_the_same_client(tmp_path, data_root):
    out = tmp_path / "dp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mpifl.bench", "--case", "dp-sgd", "--data-root", str(data_root), "--model", "smallcnn",
         "--samples-per-client", "32", "--batch-size", "8", "--rounds", "3", "--threads", "1", "--json-out",
         str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["algo"] == "fedavg-gn" and result["train_samples"] == 32
    assert len(result["mpifl"]) == len(result["bare"]) == 2 and min(result["mpifl"] + result["bare"]) > 0
    assert "ratio to bare" in proc.stdout and result["ratio_mpifl_to_bare"] > 0
