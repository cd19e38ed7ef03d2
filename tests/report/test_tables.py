import csv

import pytest
from click.testing import CliRunner

from mpifl.errors import MpiflError
from mpifl.report import build_report
from mpifl.report.__main__ import main
from mpifl.report.runs import find_runs, group_runs
from mpifl.report.tables import build_tables, csv_rows, markdown, mean_std

from .synthetic import write_run

DIGITS = ("mnist", "svhn", "usps", "synth", "mnistm")
SEED0 = {"mnist": [0.90, 0.95, 0.96], "svhn": [0.60, 0.70, 0.72], "usps": [0.90, 0.95, 0.96],
         "synth": [0.80, 0.85, 0.86], "mnistm": [0.70, 0.80, 0.82]}


def _seed1():
    return {d: [v[0], v[1], v[2] + 0.02] for d, v in SEED0.items()}


@pytest.fixture
def runs_dir(tmp_path):
    """Two seeds of FedAvg under preset fedwon-t1-digits, one FedAvg with another lr, one FedBN (personal)."""
    common = dict(algo="fedavg", data="digits", model="fedwon-cnn", rounds=3, preset="fedwon-t1-digits",
                  input_norm="pooled")  # as a run stores it, resolved
    write_run(tmp_path / "runs" / "fedavg-s0", SEED0, [0.5, 0.9, 0.8], seed=0, lr=0.1, **common)
    write_run(tmp_path / "runs" / "fedavg-s1", _seed1(), [0.5, 0.6, 0.7], seed=1, lr=0.1, device="cpu",
              threads=2, **common)
    write_run(tmp_path / "runs" / "fedavg-lr", SEED0, [0.5, 0.6, 0.7], seed=0, lr=0.01, **common)
    write_run(tmp_path / "runs" / "fedbn-s0", SEED0, [0.5, 0.6, 0.7], kinds=("personal",), seed=0, lr=0.1,
              **{**common, "algo": "fedbn"})
    return tmp_path / "runs"


def test_runs_differing_only_in_seed_and_how_they_ran_form_one_configuration(runs_dir):
    runs = find_runs([runs_dir])
    groups = group_runs(runs)
    names = [[r.path.name for r in g] for g in groups]
    assert sorted(map(sorted, names)) == [["fedavg-lr"], ["fedavg-s0", "fedavg-s1"], ["fedbn-s0"]]


def test_table_gives_last_best_mean_std_and_the_paper_beside_ours(runs_dir):
    tables = build_tables(find_runs([runs_dir]))
    by_label = {t.label: t for t in tables}
    assert set(by_label) == {"fedavg (lr=0.1)", "fedavg (lr=0.01)", "fedbn"}
    table = by_label["fedavg (lr=0.1)"]
    assert table.kind == "global" and table.seeds == [0, 1] and table.paper.method == "FedAvg"
    assert [r.domain for r in table.rows] == [*DIGITS, "mean"]
    mnist = table.row("mnist")
    assert mnist.last == pytest.approx([96.0, 98.0]) and mnist.best == pytest.approx([95.0, 98.0])  # best: r2, r3
    assert mean_std(mnist.last) == pytest.approx((97.0, 2 ** 0.5))
    assert (mnist.paper, mnist.paper_std) == (96.2, 0.2)  # FedWon Table 1 / Table 22
    text = markdown(tables)
    assert "| domain | last (round 3) | best val (round 2, 3) | paper: FedAvg (Table 1) | last − paper |" in text
    assert "| mnist | 97.00 ± 1.41 | 96.50 ± 2.12 | 96.20 ± 0.20 | +0.80 |" in text
    # seed 0: last (96+72+96+86+82)/5 = 86.4, best (round 2) 85.0; seed 1: last and best (round 3) 88.4
    assert "| mean | 87.40 ± 1.41 | 86.70 ± 2.40 | 86.50 ± 0.10 | +0.90 |" in text
    fedbn = by_label["fedbn"]
    assert fedbn.kind == "personal" and fedbn.paper.method == "FedBN"
    assert "| svhn | 72.00 | 72.00 | 77.30 ± 0.40 | -5.30 |" in markdown([fedbn])


def test_preset_comparison_section_puts_the_papers_table_beside_ours(runs_dir):
    text = markdown(build_tables(find_runs([runs_dir])))
    assert "## FedWon Table 1: Digits-Five, cross-silo (one client per domain) — ours beside the paper" in text
    assert "| method | | mnist | svhn | usps | synth | mnistm | mean |" in text
    assert ("| FedAvg | ours: fedavg (lr=0.1) (2 seeds, preset settings changed) | 97.00 | 73.00 | 97.00 | 87.00 | "
            "83.00 | 87.40 |") in text
    assert "| | paper | 96.20 | 71.60 | 96.30 | 86.00 | 82.50 | 86.50 |" in text
    assert "| | difference | +0.80 | +1.40 | +0.70 | +1.00 | +0.50 | +0.90 |" in text
    assert "not run: SingleSet, FedProx, FedAvg+GN, FedAvg+LN, SiloBN, FixBN, FedWon" in text
    # the synthetic runs did not keep the preset's settings: the report says so
    assert ("note: this configuration changed the preset's settings, so the paper's numbers are not its target: "
            "input_norm pooled (preset: fixed), rounds 3 (preset: 100), samples_per_client 0 (preset: 6600), "
            "uniform_weights None (preset: True)") in text


def test_csv_has_one_row_per_configuration_kind_and_domain(runs_dir, tmp_path):
    report = build_report([runs_dir], tmp_path / "out", plots=False)
    rows = list(csv.DictReader((tmp_path / "out" / "report.csv").open()))
    assert len(rows) == 3 * 6 == len(csv_rows(report.tables))
    row = next(r for r in rows if r["configuration"] == "fedavg (lr=0.1)" and r["domain"] == "mnist")
    assert row["seeds"] == "0 1" and row["runs"] == "2" and row["kind"] == "global"
    assert float(row["last_acc_mean"]) == pytest.approx(97.0) and float(row["diff"]) == pytest.approx(0.8)
    assert row["paper_method"] == "FedAvg" and float(row["paper_acc"]) == 96.2 and row["selection"] == "last"
    assert (tmp_path / "out" / "report.md").read_text() == report.markdown


def test_a_run_on_some_of_the_papers_domains_compares_means_over_the_domains_in_common(tmp_path):
    three = {d: SEED0[d] for d in ("mnist", "svhn", "usps")}  # last round: 96, 72, 96
    write_run(tmp_path / "r", three, [0.5, 0.6, 0.7], algo="fedavg", data="digits", model="digitmodel", rounds=3,
              preset="fedwon-t1-digits")
    tables = build_tables(find_runs([tmp_path / "r"]))
    table = tables[0]
    common = table.row("mean (in common)")
    assert common.last == pytest.approx([88.0]) and common.paper == pytest.approx((96.2 + 71.6 + 96.3) / 3)
    assert table.row("mean").paper is None  # the paper's 5-domain mean is not compared with our 3-domain one
    text = markdown(tables)
    assert "| mean (in common) | 88.00 | 88.00 | 88.03 | -0.03 |" in text
    assert "| mean | 88.00 | 88.00 | – | – |" in text
    assert ("note: mean (in common) is the mean over the 3 domains in common: mnist, svhn, usps; the paper's mean "
            "(86.50) is over its 5 domains and ours ('mean') over 3, so those two are not compared") in text
    assert "| method | | mnist | svhn | usps | synth | mnistm | mean | mean (in common) |" in text
    assert "| | paper | 96.20 | 71.60 | 96.30 | 86.00 | 82.50 | 86.50 | 88.03 |" in text
    assert "| | difference | -0.20 | +0.40 | -0.30 | – | – | – | -0.03 |" in text


def test_runs_without_preset_have_no_paper_columns_unless_one_is_given(tmp_path):
    write_run(tmp_path / "a", {"mono": [0.5, 0.6]}, [0.1, 0.2], algo="fedavg", rounds=2)
    text = markdown(build_tables(find_runs([tmp_path / "a"])))
    assert "| mono | 60.00 | 60.00 |" in text and "paper" not in text
    text = markdown(build_tables(find_runs([tmp_path / "a"]), preset_name="fedwon-t1-digits"))
    assert "note: the paper's domains mnist, svhn, usps, synth, mnistm are not among this run's domains" in text


def test_leave_one_domain_out_folds_form_one_table_of_held_out_accuracies(tmp_path):
    pacs = ("art_painting", "cartoon", "photo", "sketch")
    target = {"art_painting": 0.80, "cartoon": 0.70, "photo": 0.90, "sketch": 0.60}
    for d in pacs:
        acc = {x: [0.5, target[x] if x == d else 0.99] for x in pacs}
        acc[d] = [target[d] - 0.1, target[d]]  # the held-out domain's accuracy per round
        write_run(tmp_path / "lodo" / f"holdout-{d}", acc, [0.2, 0.3], kinds=("global", "personal"), holdout=d,
                  algo="gperxan", data="pacs", model="resnet50", rounds=2, preset="gperxan-t2-pacs")
    tables = build_tables(find_runs([tmp_path / "lodo"]))
    assert len(tables) == 1 and tables[0].lodo and tables[0].kind == "global"
    table = tables[0]
    assert [r.domain for r in table.rows] == [*pacs, "mean"]
    assert table.row("sketch").best == pytest.approx([60.0]) and table.row("mean").best == pytest.approx([75.0])
    text = markdown(tables)
    assert "| sketch (held out) | 60.00 | 60.00 | 83.28 | -23.28 |" in text  # gPerXAN Table 2, best round
    assert "| mean | 75.00 | 75.00 | 87.94 | -12.94 |" in text and "best − paper" in text


def test_find_runs_errors_are_one_line(tmp_path):
    with pytest.raises(MpiflError, match="does not exist"):
        find_runs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(MpiflError, match="no run under"):
        find_runs([tmp_path / "empty"])


@pytest.mark.parametrize("config,problem", [
    ('{"rounds": "many", "seed": 0}', "option rounds must be int, got 'many'"),
    ('{"rounds": 3, "seed": 0.5}', "option seed must be int, got 0.5"),
    ('["rounds", 3]', "holds no mapping of options"),
])
def test_a_config_json_with_a_value_of_the_wrong_kind_is_named_in_one_line(runs_dir, config, problem):
    (runs_dir / "fedavg-lr" / "config.json").write_text(config)
    with pytest.raises(MpiflError, match=f"^{runs_dir / 'fedavg-lr' / 'config.json'}(:)? {problem}; restore it "
                                         "from a copy or leave the run out$"):
        find_runs([runs_dir])
    job = CliRunner().invoke(main, [str(runs_dir)])
    assert job.exit_code == 2 and "Traceback" not in job.output and problem in job.output


def test_cli_prints_the_report_and_writes_its_files(runs_dir, tmp_path):
    result = CliRunner().invoke(main, [str(runs_dir), "--out", str(tmp_path / "r"), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "| mnist | 97.00 ± 1.41 |" in result.output
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["report.csv", "report.md"]
    bad = CliRunner().invoke(main, [str(tmp_path / "missing")])
    assert bad.exit_code == 2 and bad.output.startswith("mpifl: error:") and bad.output.count("\n") == 1


def test_an_incomplete_run_is_marked_and_left_out_of_the_means_unless_asked(tmp_path):
    """A run killed at round 3 of 10 next to a complete 10-round run of the same configuration."""
    common = dict(algo="fedavg", data="digits", model="digitmodel", rounds=10)
    write_run(tmp_path / "runs" / "s0", {"mnist": [0.9] * 10}, [0.5] * 10, seed=0, **common)
    write_run(tmp_path / "runs" / "s1", {"mnist": [0.1] * 3}, [0.5] * 3, seed=1, **common)  # killed at round 3
    result = CliRunner().invoke(main, [str(tmp_path / "runs"), "--out", str(tmp_path / "r"), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "| mnist | 90.00 | 90.00 |" in result.output  # seed 0 alone, no ± over a killed run
    assert "Left out, incomplete" in result.output and "s1 (incomplete: round 3 of 10)" in result.output
    both = CliRunner().invoke(main, [str(tmp_path / "runs"), "--out", str(tmp_path / "r"), "--no-plots",
                                     "--include-incomplete"])
    assert both.exit_code == 0 and "| mnist | 50.00 ± 56.57 |" in both.output
    assert "s1 (incomplete: round 3 of 10)" in both.output and "Left out" not in both.output
    alone = CliRunner().invoke(main, [str(tmp_path / "runs" / "s1"), "--no-plots"])
    assert alone.exit_code == 2 and "no complete run among the 1 given" in alone.output
    assert "--include-incomplete" in alone.output and alone.output.count("\n") == 1


def test_a_segmentation_run_reports_its_dice_in_a_section_marked_dice(tmp_path):
    write_run(tmp_path / "seg", {"BIDMC": [0.5, 0.8], "HK": [0.6, 0.9]}, [0.4, 0.7], metric="dice", algo="fedavg",
              data="prostate", model="unet", rounds=2)
    (table,) = build_tables(find_runs([tmp_path]))
    assert table.row("BIDMC").last == pytest.approx([80.0]) and table.row("mean").best == pytest.approx([85.0])
    text = markdown([table])
    assert "model (Dice)" in text and "| BIDMC | 80.00 | 80.00 |" in text


def test_runs_inside_a_run_are_found_and_a_record_cut_off_by_a_kill_is_left_out(tmp_path):
    """A folder of runs that is itself a run (as an older mpifl let --out runs make one): every run is reported."""
    common = dict(algo="fedavg", data="digits", model="digitmodel", rounds=3)
    write_run(tmp_path / "runs", {"mnist": [0.9] * 3}, [0.5] * 3, seed=0, **common)
    write_run(tmp_path / "runs" / "inner" / "s1", {"mnist": [0.8] * 3}, [0.5] * 3, seed=1, **common)
    with (tmp_path / "runs" / "metrics.jsonl").open("a") as f:
        f.write('{"round": 4, "cl')  # a killed run's last line
    runs = find_runs([tmp_path / "runs"])
    assert [r.path for r in runs] == [tmp_path / "runs", tmp_path / "runs" / "inner" / "s1"]
    assert [r.last_round for r in runs] == [3, 3]


def test_a_report_folder_that_cannot_be_written_is_one_line_before_any_work(runs_dir):
    run = runs_dir / "fedavg-s0"
    (run / "report").write_text("in the way")  # as a read-only run: its default output folder cannot be made
    result = CliRunner().invoke(main, [str(run), "--no-plots"])
    assert result.exit_code == 2 and result.output == (
        f"mpifl: error: cannot write into {run / 'report'}: {run / 'report'} is a file; pass --out DIR to write the "
        "report elsewhere\n")


def test_a_run_from_before_an_option_existed_groups_with_one_at_its_default_and_dp_names_the_epsilon(tmp_path):
    """A config.json without the client-level DP options (written before they existed) ran as their defaults say;
    a DP run is its own configuration, labelled with its epsilon and delta."""
    import json
    old = write_run(tmp_path / "old", SEED0, [0.5, 0.6, 0.7], seed=0)
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({k: v for k, v in config.items() if not k.startswith("dp_")}))
    write_run(tmp_path / "new", SEED0, [0.5, 0.6, 0.7], seed=1)
    write_run(tmp_path / "dp", SEED0, [0.5, 0.6, 0.7], seed=0, dp_clip=1.0, dp_noise=1.2, dp_epsilon=4.0,
              dp_delta=0.1)
    tables = build_tables(find_runs([tmp_path]))
    by_label = {t.label: t for t in tables}
    assert sorted(sorted(t.seeds) for t in tables) == [[0], [0, 1]]  # the old run and the new one together
    assert any("dp_epsilon=4.0" in label and "dp_delta=0.1" in label for label in by_label)
