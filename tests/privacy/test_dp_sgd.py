"""DP-SGD inside each client (mpifl/privacy/dp_sgd.py): per-record clipping, the noise's scale, the accountant's
epsilon against Opacus' RDP analysis computed apart, a target epsilon reached, the state that carries it over rounds
and resumes, the same bits on any number of ranks, and the one-line refusals of what it cannot protect."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from opacus.accountants.rdp import RDPAccountant

from mpifl.algorithms import REGISTRY, ClientState
from mpifl.plan.clients import ClientSpec
from mpifl.errors import MpiflError
from mpifl.privacy.dp_sgd import HISTORY, DpSgd, check, steps_per_epoch

from ..algorithms.helpers import make_algo, own_options
from ..conftest import read_metrics, run_here, untimed


def _client(n: int) -> ClientState:
    return ClientState(spec=ClientSpec(id=3, domain="mono", rows={s: np.arange(n) for s in ("train", "val", "test")}),
                       private={})


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _dp(clip=0.1, noise=1.0, batch=8, n=64):
    """DP-SGD over FedWon's normalization-free smallcnn (WSConv2d: Opacus' functorch path)."""
    algo, model = make_algo("fedwon", {"dpsgd_clip": clip, "dpsgd_noise": noise, "batch_size": batch})
    client = _client(n)
    dp = DpSgd(model, torch.optim.SGD(model.parameters(), lr=0.1), algo, client, 1)
    return algo, model, client, dp


def test_each_records_gradient_is_clipped_to_c_before_the_sum():
    torch.manual_seed(0)
    clip = 0.1
    algo, model, client, dp = _dp(clip=clip)
    x, y = 3 * torch.randn(8, 3, 28, 28), torch.arange(8)
    own = []  # each record's gradient alone, by plain autograd
    for i in range(8):
        model.zero_grad(set_to_none=True)
        algo.batch_loss(client, model, x[i:i + 1], y[i:i + 1])[0].backward()
        own.append(_flat(p.grad for p in dp.optimizer.params))
    dp.optimizer.zero_grad(set_to_none=True)
    algo.batch_loss(client, model, x, y)[0].backward()
    dp.privatize(empty=False)
    clipped = [g * min(1.0, clip / (float(g.norm()) + 1e-6)) for g in own]
    assert min(float(g.norm()) for g in own) > 10 * clip  # every record is clipped
    assert max(float(g.norm()) for g in clipped) <= clip * (1 + 1e-6)
    summed = _flat(p.summed_grad for p in dp.optimizer.params)
    assert torch.allclose(summed, sum(clipped), atol=1e-6, rtol=1e-4)
    assert float(summed.norm()) <= 8 * clip


def test_the_noise_of_a_step_without_records_has_std_sigma_c_over_the_expected_batch():
    sigma, clip, batch = 1.5, 0.7, 8
    _, model, _, dp = _dp(clip=clip, noise=sigma, batch=batch)
    dp.optimizer.zero_grad(set_to_none=True)
    dp.privatize(empty=True)  # an empty Poisson draw: the step is the noise alone
    noise = _flat(p.grad for p in dp.optimizer.params)
    assert noise.numel() > 20_000  # the std estimate within 1 % (2 standard errors)
    assert abs(float(noise.std()) / (sigma * clip / batch) - 1) < 0.05
    assert abs(float(noise.mean())) < 0.05 * sigma * clip / batch


def test_the_noise_is_drawn_from_the_clients_stream_of_its_round_whatever_torchs_global_state():
    def noise(round_index, global_seed):
        algo, model = make_algo("fedwon", {"dpsgd_clip": 1.0, "dpsgd_noise": 1.0, "batch_size": 8})
        dp = DpSgd(model, torch.optim.SGD(model.parameters(), lr=0.1), algo, _client(64), round_index)
        torch.manual_seed(global_seed)
        dp.optimizer.zero_grad(set_to_none=True)
        dp.privatize(empty=True)
        return _flat(p.grad for p in dp.optimizer.params)

    assert torch.equal(noise(2, global_seed=0), noise(2, global_seed=1))
    assert not torch.equal(noise(2, global_seed=0), noise(3, global_seed=0))


def test_the_epsilon_is_opacus_rdp_analysis_of_q_sigma_steps_and_delta():
    sigma, batch, n = 1.1, 8, 64
    _, _, client, dp = _dp(noise=sigma, batch=batch, n=n)
    for _ in range(37):
        dp.optimizer.zero_grad(set_to_none=True)
        dp.privatize(empty=True)
    epsilon = dp.finish()
    orders = RDPAccountant.DEFAULT_ALPHAS
    expected, _ = get_privacy_spent(orders=orders, rdp=compute_rdp(q=batch / n, noise_multiplier=sigma, steps=37,
                                                                   orders=orders), delta=1 / n)
    assert epsilon == pytest.approx(expected, rel=1e-12)
    assert client.private[HISTORY].tolist() == [[sigma, batch / n, 37]]


AGC = ("--agc-clip", "0.64")


def _args(data_root, out, *extra, clip="1"):
    """FedWon (scaled weight-standardized convs) under DP-SGD (``--dpsgd-clip clip``; None: without), 64 images per
    client; add :data:`AGC` for its adaptive gradient clipping (auto: off below batch size 32)."""
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--algo", "fedwon", "--lr",
            "0.05", "--threads", "1", "--samples-per-client", "64", "--batch-size", "16", "--eval-batch-size", "256",
            *(("--dpsgd-clip", clip) if clip else ()), *extra]


def test_each_rounds_epsilon_is_the_accountants_over_the_steps_taken_so_far(data_root, tmp_path):
    sigma, q, n = 0.9, 16 / 64, 64
    job = run_here(*_args(data_root, tmp_path / "r", "--rounds", "3", "--local-epochs", "2", "--dpsgd-noise",
                          str(sigma), *AGC))
    assert job.returncode == 0, job.stderr
    orders = RDPAccountant.DEFAULT_ALPHAS
    for record in read_metrics(tmp_path / "r"):
        steps = record["round"] * 2 * steps_per_epoch(n, 16)
        expected, _ = get_privacy_spent(orders=orders, rdp=compute_rdp(q=q, noise_multiplier=sigma, steps=steps,
                                                                       orders=orders), delta=1 / n)
        assert record["dp_sgd"] == {"epsilon_max": pytest.approx(expected, rel=1e-12),
                                    "epsilon_mean": pytest.approx(expected, rel=1e-12)}
    assert f"largest client epsilon {expected:.4g} (round 3)" in (tmp_path / "r" / "summary.md").read_text()


@pytest.mark.parametrize("fraction", [1.0, 0.6])
def test_a_target_epsilon_is_reached_within_five_percent_by_the_runs_end(data_root, tmp_path, fraction):
    """With partial participation each client's sigma is calibrated over the rounds it is sampled in."""
    target = 4.0
    job = run_here(*_args(data_root, tmp_path / "t", "--rounds", "3", "--dpsgd-epsilon", str(target), "--fraction",
                          str(fraction), "--dpsgd-delta", "1e-3"))
    assert job.returncode == 0, job.stderr
    records = read_metrics(tmp_path / "t")
    assert max(r["dp_sgd"]["epsilon_max"] for r in records) <= target
    # the clients of the last round have taken all their planned steps
    assert 0.95 * target <= records[-1]["dp_sgd"]["epsilon_mean"] <= target


def test_a_resumed_run_continues_every_clients_epsilon_and_model_bit_for_bit(data_root, tmp_path):
    extra = ("--dpsgd-noise", "1.0", "--clients-per-domain", "2", "--fraction", "0.5", "--seed", "3", *AGC)
    whole = run_here(*_args(data_root, tmp_path / "whole", "--rounds", "3", *extra))
    assert whole.returncode == 0, whole.stderr
    first = run_here(*_args(data_root, tmp_path / "cut", "--rounds", "2", "--ckpt-every", "1", *extra))
    assert first.returncode == 0, first.stderr
    resumed = run_here("--resume", str(tmp_path / "cut"), "--rounds", "3")
    assert resumed.returncode == 0, resumed.stderr
    assert untimed(read_metrics(tmp_path / "cut")) == untimed(read_metrics(tmp_path / "whole"))


def _refusal(job) -> str:
    """The one line of a run refused at set-up."""
    assert job.returncode != 0 and job.stderr.count("\n") == 1, job.stderr
    line = job.stderr.strip()
    assert line.startswith("mpifl: error: --dpsgd-clip: ") and "--algo fedwon" in line and "fedavg-gn" in line, line
    return line


def test_a_model_with_batch_statistics_is_refused_in_one_line_before_anything_is_written(data_root, tmp_path):
    line = _refusal(run_here(*_args(data_root, tmp_path / "bn", "--algo", "fedavg", "--dpsgd-noise", "1")))
    assert "batch statistics" in line and "running_mean" in line
    assert not (tmp_path / "bn").exists()


def test_a_method_whose_rule_per_record_clipping_cannot_follow_is_refused_in_one_line(data_root, tmp_path):
    line = _refusal(run_here(*_args(data_root, tmp_path / "m", "--algo", "mixstyle", "--norm", "gn",
                                    "--dpsgd-noise", "1")))
    assert "inserts layers of its own (adapt_model)" in line
    line = _refusal(run_here(*_args(data_root, tmp_path / "p", "--algo", "fedproto", "--norm", "gn",
                                    "--dpsgd-noise", "1")))
    assert "loss of its own (batch_loss)" in line


def test_a_trained_layer_holding_buffers_is_refused_in_one_line_naming_it():
    class Scaled(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.register_buffer("scale", torch.ones(4))

    algo, _ = make_algo("fedavg-gn", {"dpsgd_clip": 1.0, "dpsgd_noise": 1.0})
    with pytest.raises(MpiflError, match=r"^--dpsgd-clip: Opacus cannot take per-record gradients of 1 \(Scaled\), "
                                         r"a trained layer that holds buffers; use .*--algo fedwon"):
        check(algo.cfg, algo, torch.nn.Sequential(torch.nn.Linear(4, 4), Scaled()), [], 0)


@pytest.mark.parametrize("flags, problem", [
    (("--dpsgd-clip", "nan"), "--dpsgd-clip must be a finite number"),
    (("--dpsgd-clip", "-1"), "--dpsgd-clip must be > 0 (0 = off), got -1"),
    (("--dpsgd-clip", "1", "--dpsgd-noise", "inf"), "--dpsgd-noise must be a finite number"),
    (("--dpsgd-clip", "1", "--dpsgd-noise", "1", "--dpsgd-delta", "1"), "--dpsgd-delta must be in (0, 1)"),
    (("--dpsgd-clip", "1"), "give the noise as either --dpsgd-noise SIGMA or --dpsgd-epsilon TARGET"),
    (("--dpsgd-clip", "1", "--dpsgd-noise", "1", "--dpsgd-epsilon", "2"), "not both or neither"),
    (("--dpsgd-noise", "1"), "act only with DP-SGD on: give --dpsgd-clip C or drop them"),
    (("--dpsgd-clip", "1", "--dpsgd-noise", "1", "--aug", "fedrdn"), "--aug fedrdn normalizes each client's images by "
                                                                      "statistics of its records and shares them"),
    (("--dpsgd-clip", "1", "--dpsgd-noise", "1", "--precision", "bf16"), "drop --precision bf16"),
    (("--dpsgd-clip", "1", "--dpsgd-noise", "1", "--stream-above", "0"), "would stream from its shard, and Poisson "
                                                                         "sampling reads any record at any step"),
    (("--dpsgd-clip", "1", "--dpsgd-epsilon", "1e-06", "--dpsgd-delta", "1e-10"),
     "--dpsgd-epsilon 1e-06: no noise multiplier reaches it"),
])
def test_option_values_it_cannot_take_are_refused_in_one_line(data_root, tmp_path, flags, problem):
    job = run_here(*_args(data_root, tmp_path / "o", *flags, clip=None))
    assert job.returncode != 0 and job.stderr.count("\n") == 1 and problem in job.stderr, job.stderr
    assert not (tmp_path / "o").exists()


def _norm(cls) -> str:
    """A normalization without running statistics the method takes, else its own."""
    return next((kind for kind in ("gn", "ln", "none") if cls.norms is None or kind in cls.norms), "auto")


@pytest.mark.slow
def test_every_method_trains_under_dp_sgd_or_is_refused_in_one_line(data_root, style_model, tmp_path):
    supported = []
    for name, cls in sorted(REGISTRY.items()):
        run = tmp_path / name
        job = run_here("--data-root", str(data_root), "--model", "smallcnn", "--out", str(run), "--algo", name,
                       "--norm", _norm(cls), "--rounds", "1", "--samples-per-client", "16", "--batch-size", "8",
                       "--threads", "1", "--dpsgd-clip", "1", "--dpsgd-noise", "1", *own_options(name, style_model))
        if job.returncode == 0:
            assert math.isfinite(read_metrics(run)[0]["dp_sgd"]["epsilon_max"])
            supported.append(name)
        else:
            _refusal(job)
    assert {"fedavg", "fedavg-gn", "fedavg-ln", "fedwon", "fedprox", "scaffold", "feddyn"} <= set(supported)
    assert not {"mixstyle", "fedproto", "fedmix", "ccst", "fedbn", "rsc"} & set(supported)
