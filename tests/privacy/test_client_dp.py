"""Client-level differential privacy (DP-FedAvg): the clip, the noise, the accountant, the refusals, and the same
bits whoever hosts the clients."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from mpifl.algorithms import ALGORITHMS, ServerState, get_algorithm
from mpifl.data import ensure_dataset
from mpifl.errors import MpiflError
from mpifl.models import StateEntry
from mpifl.plan.config import RunConfig
from mpifl.plan.seeding import poisson_clients
from mpifl.privacy import privacy_of
from mpifl.privacy.client_dp import CLIP, UNCLIPPED

from ..algorithms.helpers import own_options
from ..conftest import read_metrics, run_here

opacus = pytest.importorskip("opacus")


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--lr", "0.05", "--threads", "1",
            "--clients-per-domain", "2", "--samples-per-client", "16", "--batch-size", "8", *extra]


def _entries(shapes: dict[str, tuple[int, ...]]) -> list[StateEntry]:
    return [StateEntry(key=k, module_kind="linear", attr=k.rsplit(".", 1)[1], is_param=True, shape=s,
                       dtype=torch.float32) for k, s in shapes.items()]


def _mechanism(shapes, training=10, **options):
    cfg = RunConfig(dp_clip=options.pop("dp_clip", 1.0), dp_noise=options.pop("dp_noise", 1.0),
                    fraction=options.pop("fraction", 0.5), **options,
                    algo_options={o.name: o.default for o in get_algorithm("fedavg").options})
    algo = get_algorithm("fedavg")(cfg, _entries(shapes))
    algo.training_ids = list(range(training))
    return privacy_of(cfg, algo, [None, None])


def _independent_epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    """Opacus' RDP analysis called directly, with the accountant's default orders."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
    orders = RDPAccountant.DEFAULT_ALPHAS
    return get_privacy_spent(orders=orders, rdp=compute_rdp(q=q, noise_multiplier=z, steps=rounds, orders=orders),
                             delta=delta)[0]


def test_each_clipped_update_has_norm_at_most_c_and_a_small_one_passes_unchanged():
    dp = _mechanism({"a.weight": (300, 200), "b.bias": (7,)})
    down = {"a.weight": torch.randn(300, 200), "b.bias": torch.randn(7), CLIP: torch.tensor([0.5], dtype=torch.float64)}
    for scale in (1e3, 10.0, 0.5, 1e-3):
        up = {k: down[k] + scale * torch.randn_like(down[k]) for k in ("a.weight", "b.bias")}
        sent = dp.privatize(dict(up), down, client=3, round_index=1)
        delta = torch.cat([(up[k] - down[k]).double().ravel() for k in up])
        norm = float(torch.cat([sent[k].double().ravel() for k in up]).norm())
        assert norm <= 0.5, (scale, norm)
        if delta.norm() <= 0.5:  # unclipped: the update itself, bit for bit
            assert all(torch.equal(sent[k], up[k] - down[k]) for k in up)
        else:  # clipped to C, in the update's direction
            assert norm == pytest.approx(0.5, rel=1e-5)
            assert torch.allclose(torch.cat([sent[k].double().ravel() for k in up]), delta * 0.5 / delta.norm(),
                                  atol=1e-6)


def test_with_no_update_the_new_global_model_moves_by_noise_of_the_stated_deviation():
    """z C / m per entry, m = qN: 0.5 x 20 = 10 clients expected, z = 1.3, C = 2."""
    dp = _mechanism({"w.weight": (1000, 1000)}, training=20, dp_noise=1.3, dp_clip=2.0)
    state = ServerState(model={"w.weight": torch.full((1000, 1000), 0.25)})
    dp.init_server(state)
    sums = {}  # a round no client took part in: nothing folded
    dp.release(state, sums, np.zeros(0, dtype=np.int64), round_index=4)
    moved = sums["w.weight"] - 0.25
    assert abs(moved.mean()) < 1e-3
    assert moved.std() == pytest.approx(1.3 * 2.0 / 10, rel=0.05)
    again = {}
    dp.release(state, again, np.zeros(0, dtype=np.int64), round_index=4)  # drawn from (seed, round)
    assert np.array_equal(again["w.weight"], sums["w.weight"])


def test_adaptive_clipping_moves_c_geometrically_toward_the_quantile():
    """Andrew et al.: b = (sum_k b_k + N(0, sigma_b^2)) / m, C <- C exp(-eta (b - gamma)), the count's noise drawn
    after the update's from the round's stream; the update's multiplier (z^-2 - (2 sigma_b)^-2)^-1/2."""
    from mpifl.plan.seeding import dp_noise_rng
    dp = _mechanism({"w.weight": (10,)}, training=10, dp_noise=0.5, dp_clipping="adaptive", dp_count_noise=1.0,
                    fraction=1.0)
    state = ServerState(model={"w.weight": torch.zeros(10)})
    dp.init_server(state)
    dp.release(state, {"w.weight": np.zeros(10), UNCLIPPED: np.array([7.0])}, np.arange(10), round_index=1)
    rng = dp_noise_rng(0, 1)
    rng.standard_normal(10)
    b = (7.0 + rng.standard_normal()) / 10
    assert float(state.extra[CLIP][0]) == pytest.approx(math.exp(-0.2 * (b - 0.5)), rel=1e-12)
    assert dp.update_noise == pytest.approx((0.5 ** -2 - 2.0 ** -2) ** -0.5)


def test_poisson_sampling_draws_each_client_with_its_rate_from_seed_and_round():
    draws = [poisson_clients(3, r, 100, 0.2) for r in range(200)]
    assert np.mean([len(d) for d in draws]) == pytest.approx(20, rel=0.05)
    assert all(np.array_equal(d, poisson_clients(3, r, 100, 0.2)) for r, d in enumerate(draws))
    assert any(len(poisson_clients(0, r, 10, 0.05)) == 0 for r in range(50))  # a round may have no client


def test_the_epsilon_of_every_round_is_the_accountants_and_dp_epsilon_is_met(data_root, tmp_path):
    """--dp-epsilon 4 over 3 rounds at q = 0.5: the noise config.json records gives, by Opacus' analysis called
    directly, each round's epsilon in metrics.jsonl, and the last is in [0.95 E, E]."""
    run = tmp_path / "run"
    job = run_here(*_args(data_root, run, "--rounds", "3", "--fraction", "0.5", "--dp-clip", "0.5",
                          "--dp-epsilon", "4"))
    assert job.returncode == 0, job.stderr
    config = json.loads((run / "config.json").read_text())
    z, delta = config["dp_noise"], config["dp_delta"]
    assert delta == 1 / 10 and z > 0
    records = read_metrics(run)
    for record in records:
        spent = record["privacy"]
        assert spent["epsilon"] == pytest.approx(_independent_epsilon(0.5, z, record["round"], delta), rel=1e-12)
        assert (spent["delta"], spent["noise_multiplier"], spent["clip"]) == (delta, z, 0.5)
    assert 0.95 * 4 <= records[-1]["privacy"]["epsilon"] <= 4 == config["dp_epsilon"] or \
        records[-1]["privacy"]["epsilon"] == pytest.approx(config["dp_epsilon"])
    assert f"epsilon {records[-1]['privacy']['epsilon']:.4g} at delta 0.1" in (run / "summary.md").read_text()
    assert "client-level DP: clip 0.5 (fixed)" in (run / "log.txt").read_text()


@pytest.mark.parametrize("extra,named", [
    (("--dp-clip", "-1", "--dp-noise", "1"), "--dp-clip must be > 0"),
    (("--dp-clip", "1", "--dp-noise", "-0.5"), "--dp-noise must be > 0"),
    (("--dp-clip", "1", "--dp-noise", "0"), "--dp-noise must be > 0"),
    (("--dp-clip", "1", "--dp-epsilon", "0"), "--dp-epsilon must be > 0"),
    (("--dp-clip", "1", "--dp-noise", "1", "--dp-delta", "1"), "--dp-delta must be in (0, 1)"),
    (("--dp-clip", "1", "--dp-noise", "1", "--dp-delta", "0"), "--dp-delta must be in (0, 1)"),
    (("--dp-clip", "nan", "--dp-noise", "1"), "--dp-clip must be a finite number"),
    (("--dp-clip", "1", "--dp-noise", "inf"), "--dp-noise must be a finite number"),
    (("--dp-clip", "1",), "--dp-clip needs --dp-noise"),
    (("--dp-noise", "1",), "--dp-noise 1.0 acts only with --dp-clip"),
    (("--secagg-bits", "48",), "--secagg-bits 48 acts only with --secure-aggregation"),
    (("--dp-clip", "1", "--dp-noise", "1", "--dp-epsilon", "0.5"), "past --dp-epsilon 0.5"),
    (("--dp-clip", "1", "--dp-epsilon", "1e-9", "--dp-delta", "1e-9"),
     "--dp-epsilon 1e-09: no noise multiplier reaches"),
    (("--dp-clip", "1", "--dp-noise", "1", "--algo", "scaffold"), "--dp-clip: --algo scaffold uploads"),
    (("--dp-clip", "1", "--dp-noise", "1", "--aug", "fedrdn"), "exchanges"),
    (("--dp-clip", "1", "--dp-noise", "3", "--dp-clipping", "adaptive"), "--dp-clipping adaptive: the count"),
])
def test_bad_privacy_input_is_one_line_before_anything_is_written(data_root, tmp_path, extra, named):
    job = run_here(*_args(data_root, tmp_path / "run", "--rounds", "1", *extra))
    assert job.returncode != 0
    lines = job.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], job.stderr
    assert not (tmp_path / "run").exists()


SUPPORTED = {"fedavg", "fedprox", "fedbn", "fedavgm", "fedadam", "fedwon", "fedavg-gn", "gperxan", "fixbn"}
REFUSED = {"scaffold", "fedproto", "fedmix", "ccst", "elcfs", "feddyn", "fednova", "feddg-ga", "singleset", "fedstein"}
#: supported methods run for two rounds, one per way the rule meets the noise: FedAvg's mean, a server optimizer's
#: step, personal BN kept, a stage change (FixBN stops sending statistics), a head kept (FedRep); the others are
#: checked at set-up, where a refusal is decided
RUN = {"fedavg", "fedadam", "fedbn", "fixbn", "fedrep"}


def test_every_method_is_supported_or_refused_in_one_line_at_set_up(data_root, style_model):
    from mpifl.job.cli import configuration
    from mpifl.session.session import make_session
    manifest = ensure_dataset(data_root, "styledigits")
    supported, refused = set(), set()
    for algo in sorted(ALGORITHMS):
        cfg = configuration(["--data-root", str(data_root), "--model", "smallcnn", "--algo", algo, "--dp-clip", "1",
                             "--dp-noise", "1", *own_options(algo, style_model)])[0]
        try:
            make_session(cfg, manifest, num_hosts=1)
            supported.add(algo)
        except MpiflError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(f"--dp-clip: --algo {algo}"), (algo, str(exc))
            refused.add(algo)
    assert SUPPORTED <= supported and REFUSED <= refused and supported | refused == set(ALGORITHMS)


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(RUN))
def test_a_supported_method_runs_two_rounds_under_client_level_dp(data_root, tmp_path, algo):
    run = tmp_path / "run"
    own = ("--fixbn-stage-rounds", "1") if algo == "fixbn" else ()
    job = run_here(*_args(data_root, run, "--algo", algo, "--rounds", "2", "--samples-per-client", "8",
                          "--dp-clip", "1", "--dp-noise", "1", *own))
    assert job.returncode == 0, job.stderr
    assert [r["privacy"]["epsilon"] > 0 for r in read_metrics(run)] == [True, True]


def test_local_noise_is_each_clients_and_the_accountant_counts_its_rounds(data_root, tmp_path):
    """--dp-mode local: rank 0 adds nothing; epsilon is the Gaussian mechanism at z/2 over the most rounds a client
    took part in, without amplification."""
    run = tmp_path / "run"
    job = run_here(*_args(data_root, run, "--rounds", "3", "--fraction", "0.5", "--dp-clip", "0.5", "--dp-noise", "4",
                          "--dp-mode", "local", "--seed", "2"))
    assert job.returncode == 0, job.stderr
    records = read_metrics(run)
    taken = np.zeros(10)
    for record in records:
        taken[record["clients"]] += 1
        assert record["privacy"]["epsilon"] == pytest.approx(_independent_epsilon(1.0, 2.0, int(taken.max()), 0.1))


@pytest.mark.slow
def test_secure_aggregation_of_clipped_updates_releases_the_dp_model_within_the_quantization_bound(data_root, tmp_path):
    """--dp-clip with --secure-aggregation: the clients mask their clipped updates, each weighed 1/m, and rank 0 adds
    the same noise to the dequantized sum; one round's model is the plain DP run's within K / 2^(f+1).  A seed whose
    Poisson sample has a round of one client (seed 3: round 1) is refused before anything is written."""
    lone = run_here(*_args(data_root, tmp_path / "lone", "--seed", "3", "--fraction", "0.5", "--dp-clip", "1",
                           "--dp-noise", "1", "--secure-aggregation"))
    assert lone.returncode and "round 1 of this run's Poisson sample" in lone.stderr
    assert not (tmp_path / "lone").exists()
    extra = ("--rounds", "1", "--fraction", "0.5", "--seed", "4", "--dp-clip", "0.5", "--dp-noise", "1",
             "--ckpt-every", "1")
    plain = run_here(*_args(data_root, tmp_path / "plain", *extra))
    masked = run_here(*_args(data_root, tmp_path / "masked", *extra, "--secure-aggregation"))
    assert plain.returncode == 0 and masked.returncode == 0, plain.stderr + masked.stderr
    k = len(read_metrics(tmp_path / "masked")[0]["clients"])
    f = 32 - 1 - k.bit_length() - 4  # --secagg-bits 32, --secagg-range 16
    load = lambda run: torch.load(run / "checkpoint" / "round-1" / "server.pt", weights_only=True)["model"]  # noqa
    a, b = load(tmp_path / "plain"), load(tmp_path / "masked")
    for key in a:
        gap = (a[key].double() - b[key].double()).abs()
        allowed = k * 2.0 ** -(f + 1) + 2 * torch.finfo(torch.float32).eps * a[key].double().abs()
        assert bool((gap <= allowed).all()), key
    assert any(not torch.equal(a[key], b[key]) for key in a)  # the masked run went through fixed point
    assert "secure aggregation: masked uploads" in (tmp_path / "masked" / "log.txt").read_text()


def test_without_the_privacy_extra_a_dp_option_is_one_line_naming_it(data_root, tmp_path, monkeypatch):
    import importlib
    real = importlib.import_module

    def without_opacus(name, *args, **kwargs):
        if name.split(".")[0] == "opacus":
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", without_opacus)
    job = run_here(*_args(data_root, tmp_path / "run", "--dp-clip", "1", "--dp-noise", "1"))
    lines = job.stderr.strip().splitlines()
    assert job.returncode and len(lines) == 1 and 'pip install -e ".[privacy]"' in lines[0], job.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_three_mechanisms_compose_in_one_run(data_root, tmp_path):
    """DP-SGD inside the clients, their updates clipped and masked, the noise added to the dequantized sum: both
    guarantees are reported, each by its own accountant."""
    run = tmp_path / "run"
    job = run_here(*_args(data_root, run, "--algo", "fedavg-gn", "--rounds", "2", "--fraction", "0.5", "--seed", "4",
                          "--samples-per-client", "32", "--dp-clip", "1", "--dp-noise", "1", "--dpsgd-clip", "1",
                          "--dpsgd-noise", "1", "--secure-aggregation"))
    assert job.returncode == 0, job.stderr
    last = read_metrics(run)[-1]
    assert last["privacy"]["epsilon"] == pytest.approx(_independent_epsilon(0.5, 1.0, 2, 0.1))
    assert last["dp_sgd"]["epsilon_max"] > 0
    summary = (run / "summary.md").read_text()
    assert "client-level DP (central)" in summary and "Record-level DP-SGD" in summary
