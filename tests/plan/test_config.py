import dataclasses
import json

import pytest

from mpifl.algorithms import all_options
from mpifl.plan.config import (CORE_KEYS, RESUMABLE, RUN_OPTIONS, Option, RunConfig, check, read_config_file, resolve,
                               resumable, run_config)
from mpifl.errors import MpiflError

from ..conftest import run_here

MU = {"mu": Option("mu", float, 0.01, "prox")}


def test_defaults_then_file_then_cli():
    cfg = resolve({"rounds": 7, "lr": 0.5, "mu": 0.2}, {"lr": 0.1}, MU)
    assert cfg.rounds == 7 and cfg.lr == 0.1 and cfg.opt("mu") == 0.2
    assert cfg.batch_size == RunConfig().batch_size


def test_algorithm_option_default_when_unset():
    assert resolve({}, {}, MU).opt("mu") == 0.01


def test_yaml_and_json_files_with_dashed_keys(tmp_path):
    (tmp_path / "a.yaml").write_text("local-epochs: 3\nalgo: fedprox\n")
    (tmp_path / "b.json").write_text(json.dumps({"batch_size": 8}))
    assert read_config_file(tmp_path / "a.yaml") == {"local_epochs": 3, "algo": "fedprox"}
    assert read_config_file(tmp_path / "b.json") == {"batch_size": 8}


def test_bad_files_and_keys_are_one_line_errors(tmp_path):
    with pytest.raises(MpiflError, match="not found"):
        read_config_file(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{rounds: ")
    with pytest.raises(MpiflError, match="cannot parse") as info:
        read_config_file(tmp_path / "bad.json")
    assert "\n" not in str(info.value)
    with pytest.raises(MpiflError, match="unknown option"):
        resolve({"roundz": 3}, {}, MU)
    with pytest.raises(MpiflError, match="rounds must be int"):
        resolve({"rounds": "many"}, {}, MU)
    with pytest.raises(MpiflError, match="rounds must be int"):
        resolve({"rounds": 2.5}, {}, MU)


def test_range_checks():
    with pytest.raises(MpiflError, match="--fraction"):
        check(RunConfig(fraction=0))
    with pytest.raises(MpiflError, match="--device"):
        check(RunConfig(device="tpu"))
    with pytest.raises(MpiflError, match="either --num-clients or --clients-per-domain"):
        check(RunConfig(num_clients=10, clients_per_domain=2))
    check(RunConfig())


def test_one_entry_of_the_table_is_a_whole_run_option():
    """Issue 49: a run option is one entry of RUN_OPTIONS.  Added to a table, that entry alone gives the run's field,
    its check, its --help line and flag (a bool one a flag without value), its row in its group of the options page,
    its resume rule and its part in the report's grouping of runs."""
    import click

    from mpifl.job.cli import command
    from mpifl.job.options_doc import options_markdown
    from mpifl.report.runs import group_key, ignored_keys

    depth = Option("probe_depth", int, 3, "probe: how deep it looks", minimum=1, group="Evaluation",
                   resumable=True, names_result=False)
    quick = Option("probe_quick", bool, False, "probe: whether it looks quickly", group="Evaluation")
    table = RUN_OPTIONS + (depth, quick)
    assert "probe_depth" not in CORE_KEYS and "probe_depth" not in RESUMABLE  # the real table is left alone

    config = run_config(table)
    assert (config().probe_depth, config().probe_quick) == (3, False)
    with pytest.raises(MpiflError, match=r"^--probe-depth must be >= 1, got 0$"):
        check(config(probe_depth=0), table)
    check(config(probe_depth=2, probe_quick=True), table)

    cmd = command(table)
    shown = " ".join(cmd.get_help(click.Context(cmd, info_name="mpifl.run", **cmd.context_settings)).split())
    assert "--probe-depth INTEGER probe: how deep it looks [default: 3]" in shown
    assert "--probe-quick probe: whether it looks quickly" in shown
    given = cmd.make_context("mpifl.run", ["--probe-depth", "5", "--probe-quick"]).params
    assert (given["probe_depth"], given["probe_quick"]) == (5, True)

    evaluation = options_markdown(table).split("\n## Evaluation\n", 1)[1].split("\n## ", 1)[0]
    assert "| `--probe-depth INTEGER` | `3` | probe: how deep it looks |" in evaluation
    assert "| `--probe-quick` |  | probe: whether it looks quickly |" in evaluation

    assert "probe_depth" in resumable(table) and "probe_quick" not in resumable(table)
    resume = next(p for p in cmd.params if p.name == "resume")
    assert "--probe-depth" in resume.help and "--probe-quick" not in resume.help

    ignored = ignored_keys(table)
    runs = [{"algo": "fedavg", "probe_depth": d, "probe_quick": q} for d, q in ((2, False), (5, False), (2, True))]
    assert group_key(runs[0], ignored) == group_key(runs[1], ignored) != group_key(runs[2], ignored)


def test_flat_round_trip():
    cfg = resolve({}, {"seed": 4}, MU)
    again = resolve(cfg.to_flat(), {}, MU)
    assert again == cfg


def _float_options():
    core = [f.name for f in dataclasses.fields(RunConfig) if isinstance(f.default, float)]
    methods = [o.name for o in all_options().values() if o.type is float]
    return [(name, None) for name in core] + [(name, all_options()[name]) for name in methods]


@pytest.mark.parametrize("name,option", _float_options())
def test_every_float_option_core_or_method_refuses_a_number_that_is_not_finite(name, option):
    declared = {name: option} if option else {}
    for value in ("nan", "inf", "-inf", "1e400", float("nan"), float("-inf")):
        with pytest.raises(MpiflError) as error:
            resolve({name: value}, {}, declared)  # from a file (strings or numbers), as from the command line
        assert str(error.value).startswith(f"--{name.replace('_', '-')} must be a finite number, got "), value
    assert resolve({}, {name: "1e-3"}, declared).to_flat()[name] == 1e-3


@pytest.mark.parametrize("args,words", [
    (("--lr", "inf"), "--lr must be a finite number, got inf"),
    (("--lr", "1e400"), "--lr must be a finite number, got inf"),
    (("--algo", "fedprox", "--mu", "nan"), "--mu must be a finite number, got nan"),
    (("--algo", "fedavgm", "--server-lr", "nan"), "--server-lr must be a finite number, got nan"),
    (("--algo", "fedavgm", "--server-momentum", "nan"), "--server-momentum must be a finite number, got nan"),
    (("--algo", "fedprox", "--mu", "-1"), "--mu must be >= 0, got -1.0"),
    (("--algo", "fedavgm", "--server-lr", "-1"), "--server-lr must be > 0, got -1.0"),
])
def test_the_issues_options_are_refused_in_one_line_before_anything_is_written(data_root, tmp_path, args, words):
    job = run_here("--data-root", str(data_root), "--model", "smallcnn", "--rounds", "1", "--out",
                   str(tmp_path / "run"), *args)
    assert job.returncode == 2
    assert (job.stdout + job.stderr).strip().splitlines() == [f"mpifl: error: {words}"], job.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name,text", [
    ("a.yaml", "lr: 0.1\nrounds: 3\nlr: 0.2\n"),
    ("b.yaml", "local-epochs: 2\nlocal_epochs: 3\n"),
    ("c.json", '{"lr": 0.1, "lr": 0.2}'),
    ("d.json", '{"batch-size": 8, "batch_size": 16}'),
])
def test_an_option_given_twice_in_a_config_file_is_refused_in_one_line(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(MpiflError, match=f"^config file {tmp_path / name} gives option (lr|local_epochs|batch_size) "
                                         "twice; keep one$"):
        read_config_file(tmp_path / name)


def test_a_mapping_inside_a_config_file_value_reads_as_a_mapping(tmp_path):
    (tmp_path / "a.yaml").write_text("notes: {a: 1, b: [1, 2]}\nrounds: 2\n")
    (tmp_path / "b.json").write_text('{"notes": {"a": 1, "b": [1, 2]}, "rounds": 2}')
    for name in ("a.yaml", "b.json"):
        assert read_config_file(tmp_path / name) == {"notes": {"a": 1, "b": [1, 2]}, "rounds": 2}


def _built(*argv):
    from mpifl.job.cli import configuration
    return configuration(argv)[0]


@pytest.mark.parametrize("argv,flag,where", [
    (["--input-norm", "domain", "--aug", "fedrdn"], "--input-norm domain", "with --aug none"),
    (["--aug-draw", "sample"], "--aug-draw sample", "with --aug fedrdn"),
    (["--aug", "norm", "--aug-draw", "sample"], "--aug-draw sample", "with --aug fedrdn"),
    (["--aug-stats", "raw"], "--aug-stats raw", "with --aug norm, fedrdn or fedrdn-v"),
])
def test_an_option_given_where_it_does_nothing_is_refused_not_recorded(tmp_path, argv, flag, where):
    with pytest.raises(MpiflError, match=f"^{flag} acts only {where}.*; drop {flag.split()[0]}$"):
        _built(*argv)
    (tmp_path / "exp.yaml").write_text(f"{argv[0][2:]}: {argv[1]}\n")
    with pytest.raises(MpiflError, match=f"^{flag} acts only"):  # from a config file alike
        _built("--config", str(tmp_path / "exp.yaml"), *argv[2:])


def test_where_they_act_or_come_from_a_preset_or_the_resumed_run_they_are_taken(tmp_path):
    assert _built("--aug", "fedrdn", "--aug-draw", "sample", "--aug-stats", "raw").aug_draw == "sample"
    assert _built("--input-norm", "domain").input_norm == "domain"
    # a preset's base sets --input-norm for its --aug none rows; its FedRDN rows only change --aug
    cfg = _built("--preset", "fedrdn-t1-domainnet", "--aug", "fedrdn")
    assert (cfg.aug, cfg.input_norm) == ("fedrdn", "fixed")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**cfg.to_flat(), "out": str(run)}))
    assert _built("--rounds", "20", "--resume", str(run)).input_norm == "fixed"  # a resume reads its own config back


@pytest.mark.parametrize("option", [o for o in RUN_OPTIONS if o.type is float], ids=lambda o: o.flag)
def test_every_float_option_refuses_a_value_that_is_not_finite_in_one_line(option):
    for value in (float("nan"), float("inf"), float("-inf")):
        assert option.problem(value) == f"{option.flag} must be a finite number, got {value}"
