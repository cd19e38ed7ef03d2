import json
import subprocess
import sys

import pytest

from mpifl.bench import fold_seconds, speedup_bound


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
