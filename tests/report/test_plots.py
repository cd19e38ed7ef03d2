import matplotlib.pyplot as plt

from mpifl.report import build_report
from mpifl.report.plots import plot_runs
from mpifl.report.runs import find_runs

from .synthetic import write_run

PNG = b"\x89PNG\r\n\x1a\n"


def test_figures_are_written_with_stable_names_non_empty_and_none_left_open(tmp_path):
    acc = {"mono": [0.2, 0.5, 0.7], "street": [0.1, 0.3, 0.4]}
    for seed in (0, 1):
        write_run(tmp_path / "runs" / f"fedavg-s{seed}", acc, [0.1, 0.2, 0.3], seed=seed, algo="fedavg", rounds=3)
    write_run(tmp_path / "runs" / "fedbn", acc, [0.1, 0.2, 0.3], kinds=("personal",), algo="fedbn", rounds=3,
              bytes_down=400, seconds=0.2)
    before = plt.get_fignums()
    files = plot_runs(find_runs([tmp_path / "runs"]), tmp_path / "out")
    assert [f.name for f in files] == ["accuracy-mono.png", "accuracy-street.png", "accuracy-mean.png",
                                       "bytes-per-round.png", "seconds-per-round.png"]
    for f in files:
        data = f.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, f  # a real plot with axes, labels and a legend
    assert plt.get_fignums() == before  # Figure objects on the Agg canvas: nothing registered with pyplot


def test_runs_with_a_simulated_clock_get_accuracy_against_simulated_time(tmp_path):
    acc = {"mono": [0.2, 0.5, 0.7]}
    write_run(tmp_path / "runs" / "clocked", acc, [0.1, 0.2, 0.3], algo="fedbuff", rounds=3, sim=[4.0, 9.5, 12.0])
    write_run(tmp_path / "runs" / "plain", acc, [0.1, 0.2, 0.3], algo="fedavg", rounds=3)
    runs = find_runs([tmp_path / "runs"])
    assert "accuracy-mean-simulated-time.png" in [f.name for f in plot_runs(runs, tmp_path / "out")]
    assert not any(f.name.endswith("simulated-time.png") for f in plot_runs([r for r in runs if r.path.name ==
                                                                              "plain"], tmp_path / "plain"))


def test_report_writes_tables_and_figures(tmp_path):
    write_run(tmp_path / "run", {"mono": [0.2, 0.5]}, [0.1, 0.2], algo="fedavg", rounds=2)
    report = build_report([tmp_path / "run"], tmp_path / "out")
    assert sorted(p.name for p in report.files) == ["accuracy-mean.png", "accuracy-mono.png", "bytes-per-round.png",
                                                    "report.csv", "report.md", "seconds-per-round.png"]
