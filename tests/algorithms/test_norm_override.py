"""--norm: the run's normalization kind over the method's own, refused in one line where the rule needs its own;
gPerXAN's ablation with IBN-a and DSON in place of PerXAN."""

import pytest
from torch import nn

from mpifl.algorithms import get_algorithm
from mpifl.errors import MpiflError
from mpifl.models import DSON, IBN, state_entries
from mpifl.plan.config import RunConfig

from ..conftest import read_metrics, run_here


def _built(algo, norm="auto", model="smallcnn", **core):
    """(algorithm, network) as the session builds them, with ``--norm norm``."""
    cls = get_algorithm(algo)
    cfg = RunConfig(algo=algo, model=model, norm=norm, algo_options={o.name: o.default for o in cls.options},
                    **core)
    net = cls.network(cfg, num_classes=10, image_size=(28, 28))
    return cls(cfg, state_entries(net)), net


def _kinds(net):
    return [type(net.norm1), type(net.norm2), type(net.norm3)]


def test_auto_is_the_methods_own_kind_and_norm_overrides_it():
    assert _kinds(_built("fedavg")[1]) == [nn.BatchNorm2d] * 3
    assert _kinds(_built("fedavg", "gn")[1]) == [nn.GroupNorm] * 3
    assert _kinds(_built("fedavg", "ibn")[1]) == [IBN, IBN, nn.BatchNorm2d]  # IBN-a: every stage but the last
    assert _kinds(_built("fedavg", "ibn", norm_blocks="all")[1]) == [IBN] * 3
    assert _kinds(_built("fedprox", "dson")[1]) == [DSON] * 3
    assert _kinds(_built("fedwon")[1]) == [nn.Identity] * 3


@pytest.mark.parametrize("algo, norm, because", [
    ("fedwon", "bn", "removes every normalization layer"),
    ("fedstein", "bn", "is defined by its JSNorm layers"),
    ("fednn", "gn", "is defined by its adaptive group norm layers"),
    ("gperxan", "bn", "keeps the BN side of composite norm layers personal"),
    ("fedbn", "gn", "keeps BN layers"),
    ("silobn", "ln", "keeps BN running statistics"),
    ("fixbn", "dson", "freezes the running statistics of BatchNorm modules"),
    ("fedavg-gn", "ln", "is FedAvg with --norm gn"),
])  # fmt: skip
def test_a_method_whose_rule_needs_its_own_kind_refuses_others_in_one_line(algo, norm, because):
    with pytest.raises(MpiflError) as info:
        _built(algo, norm)
    message = str(info.value)
    assert message.startswith(f"--norm {norm}: {algo} {because}") and "\n" not in message


def _manifest(algo):
    policy = algo.policy()
    return {s.name for s in policy.download}, {s.name for s in policy.private}


def test_fedbn_with_ibn_keeps_the_bn_half_local_and_averages_the_in_half():
    down, private = _manifest(_built("fedbn", "ibn")[0])
    halves = {f"norm{i}.bn.{a}" for i in (1, 2)
              for a in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}
    plain = {f"norm3.{a}" for a in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}
    assert private == halves | plain
    assert {f"norm{i}.inorm.{a}" for i in (1, 2) for a in ("weight", "bias")} <= down


def test_gperxan_with_ibn_keeps_the_bn_half_personal_and_shares_the_in_half_and_the_later_plain_bn():
    down, private = _manifest(_built("gperxan", "ibn")[0])
    assert private == {f"norm{i}.bn.{a}" for i in (1, 2)
                       for a in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
                       } | {"norm3.num_batches_tracked"}  # fmt: skip
    assert {f"norm{i}.inorm.{a}" for i in (1, 2) for a in ("weight", "bias")} <= down
    assert {"norm3.weight", "norm3.bias", "norm3.running_mean", "norm3.running_var"} <= down


def test_gperxan_with_dson_keeps_every_dson_entry_personal():
    down, private = _manifest(_built("gperxan", "dson")[0])
    assert private == {f"norm{i}.{a}" for i in (1, 2, 3)
                       for a in ("weight", "bias", "mean_weight", "var_weight", "running_mean", "running_var",
                                 "num_batches_tracked")}  # fmt: skip
    assert not any(k.startswith("norm") for k in down)


def test_norm_blocks_wins_over_perxan_blocks_for_gperxan():
    cls = get_algorithm("gperxan")
    options = {o.name: o.default for o in cls.options} | {"perxan_blocks": "1"}
    cfg = RunConfig(algo="gperxan", model="smallcnn", algo_options=options)
    assert cls.norm_placement(cfg) == ("1", "--perxan-blocks")
    cfg.norm_blocks = "2"
    assert cls.norm_placement(cfg) == ("2", "--norm-blocks")


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--lr", "0.05", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["ibn", "dson"])
def test_gperxan_ablation_runs_two_rounds_in_process(data_root, tmp_path, norm):
    run = tmp_path / norm
    job = run_here(*_args(data_root, run, "--algo", "gperxan", "--norm", norm, "--rounds", "2",
                          "--samples-per-client", "64"))
    assert job.returncode == 0, job.stderr
    records = read_metrics(run)
    assert [r["round"] for r in records] == [1, 2]
    manifest = run_here(*_args(data_root, tmp_path / "m", "--algo", "gperxan", "--norm", norm, "--show-manifest"))
    down = int(next(line for line in manifest.stdout.splitlines() if line.startswith("download"))
               .split(" bytes per client")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert all(r["bytes"]["down"] == down * len(r["clients"]) for r in records)
    assert all(0 <= r["eval"]["personal"]["test"]["mean"]["acc"] <= 1 for r in records)


@pytest.mark.slow
def test_cli_refuses_an_unknown_norm_and_a_method_that_cannot_take_it_in_one_line(data_root, tmp_path):
    job = run_here(*_args(data_root, tmp_path / "a", "--norm", "xn"))
    assert job.returncode != 0 and len(job.stderr.strip().splitlines()) == 1
    assert "--norm must be one of auto, bn, gn, ln, in, none, perxan, agn, jsbn, ibn, dson, got 'xn'" in job.stderr
    job = run_here(*_args(data_root, tmp_path / "b", "--algo", "fedwon", "--norm", "bn"))
    assert job.returncode != 0 and len(job.stderr.strip().splitlines()) == 1
    assert "--norm bn: fedwon removes every normalization layer" in job.stderr
