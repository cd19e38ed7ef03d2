"""``python -m mpifl.bench --case dp-sgd`` (mpifl/privacy/cost.py): one client's DP-SGD local training in mpifl and in
a bare Opacus loop, round by round."""

import json
import subprocess
import sys


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
