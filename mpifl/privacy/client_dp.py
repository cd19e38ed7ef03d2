"""Client-level differential privacy: DP-FedAvg (McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private
Recurrent Language Models", ICLR 2018), with adaptive clipping as a choice (Andrew, Thakkar, McMahan & Ramaswamy,
"Differentially Private Learning with Adaptive Clipping", NeurIPS 2021).

Each round every training client takes part independently with probability q = ``--fraction`` (Poisson sampling,
drawn from (seed, round): :func:`~mpifl.plan.seeding.participants`), m = qN clients expected.  A sampled client's
update Delta_k = theta_k - theta (what it uploads less what it downloaded, over every uploaded model entry, BN
statistics included) is clipped on its host rank to L2 norm C::

    Delta_k <- Delta_k min(1, C / ||Delta_k||)          (a margin of 2^-20 covers float32 rounding)

and rank 0 releases the mean with a fixed denominator, every client weighing 1 whatever its sample count::

    theta' = theta + (sum_k Delta_k + N(0, z^2 C^2 I)) / m

then hands theta' to the method's own rule as the clients' mean (:meth:`Algorithm.global_value`: FedAdam's, FedAvgM's
server steps are post-processing).  The noise is drawn on rank 0 from (seed, round), so runs are rank-count
invariant.  ``--dp-mode local`` moves the noise to the clients (each adds N(0, z^2 C^2) to its clipped update before
upload, from (seed, client, round)) and rank 0 adds none.

Adaptive clipping (Andrew et al., Algorithm 1): each client also uploads b_k = 1[||Delta_k|| <= C]; rank 0 releases
b = (sum_k b_k + N(0, sigma_b^2)) / m and moves C <- C exp(-eta_C (b - gamma)).  The update's noise multiplier is
z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2, so that the round is one Gaussian mechanism of multiplier z (their
Theorem 1); sigma_b defaults to m/20, their choice.  C is sent down each round.

Accounting (:mod:`.accountant`): central, the sampled Gaussian mechanism at rate q and multiplier z, one step a round;
the guarantee is at the client level (one client's whole data added or removed), against anyone who sees the models
rank 0 releases, with rank 0 trusted.  Local, each client's update is a Gaussian mechanism of multiplier z/2 (a
replaced update moves by up to 2C), unamplified (rank 0 sees who uploads), over the rounds the client took part in;
the epsilon reported is the largest over the clients, and it holds against rank 0 too.

The sample and the noise come from the run's seed, for runs that repeat bit for bit: the guarantee is that of
the mechanism as simulated, for a deployment whose randomness its adversary cannot see (whoever knows the seed
knows the sample and can subtract the noise).

Rank 0 sees what the method's manifest sends (the clipped updates, individually, in the central mode): the
guarantee is about what it releases.  A method whose server rule reads anything but each uploaded entry's mean
(gathered tensors, sums of its own, results of training, a one-time exchange of data-derived tensors) is refused in
one line (:func:`refusal`): the clipped update would not bound what it releases.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..algorithms import Algorithm, Reduction, ServerState, Uploads
from ..errors import MpiflError
from ..plan.config import RunConfig
from ..plan.seeding import dp_noise_rng, dp_client_generator
from ..transport.share import SharePolicy
from ..transport.wire import TensorSpec
from . import accountant
from .mechanism import Privacy

CLIP = "privacy.clip"  # C of the round, sent down; in ServerState.extra
UNCLIPPED = "privacy.unclipped"  # b_k, uploaded and summed (adaptive clipping)
HISTORY = "privacy.history"  # the accountant's (z, q, steps) rows, in ServerState.extra
PARTICIPATIONS = "privacy.participations"  # (N,) rounds each training client took part in (local mode)
MARGIN = 1.0 - 2.0 ** -20  # of the clip factor: float32 rounding of the scaled update stays under C
FLAG = "--dp-clip"


def refusal(algo: Algorithm, exchanges: list[TensorSpec | None]) -> tuple[str, str] | None:
    """Why client-level DP cannot bound what ``algo``'s server rule releases: (a few words for docs/privacy.md's
    table, the one-line refusal), or None."""
    name = algo.name
    setup = [spec for spec in exchanges if spec is not None]
    if setup:
        what = setup[0].derived or setup[0].name
        return "a one-time exchange", (
            f"{FLAG}: --algo {name} (or --aug) exchanges {setup[0].name} ({what}) once before round 1, outside the "
            "rounds' clipped and noised updates, so no guarantee would cover it; drop the option that makes the "
            "exchange, or pick a method without one")
    if algo.asynchronous:
        return "asynchronous", (f"{FLAG}: --algo {name} aggregates asynchronously, one buffer of stale updates a "
                                "step, which the accountant of Poisson-sampled rounds does not describe; pick a "
                                "synchronous method")
    if not algo.uploaded_keys:
        return "uploads no model entry", (f"{FLAG}: --algo {name} uploads no model entry, so there is no update to "
                                          f"make private; drop {FLAG}")
    extra = [spec.name for spec in algo.extra_upload()] or algo.gathered_keys()
    if extra:
        return "uploads beyond the model", (
            f"{FLAG}: --algo {name} uploads {', '.join(extra)} beyond the model, which its server rule reads client "
            "by client, so rank 0 would release what the clipped update does not bound; pick a method whose rule is "
            "a mean of the model (fedavg, fedprox, fedbn, fedavgm, fedadam ...)")
    if algo.reductions_need_results:
        return "weights from training", (
            f"{FLAG}: --algo {name} weighs the uploads by what training returned, so the clients' weights cannot be "
            "the fixed ones the noise is calibrated to; pick a method whose rule is a mean")
    planned = Uploads(clients=np.zeros(1, dtype=np.int64), meta=np.ones(1, dtype=[("num_samples", np.int64)]),
                      tensors={})
    sums = algo.reductions(ServerState(model={}), planned)
    if set(sums) != set(algo.uploaded_keys) or any(r.upload != key for key, r in sums.items()):
        own = sorted(set(sums) - set(algo.uploaded_keys))
        return "sums of its own", (
            f"{FLAG}: --algo {name}'s server rule reads sums of its own ({', '.join(own[:2])}"
            f"{' ...' * (len(own) > 2)}) beyond each uploaded entry's mean, which the noise is not calibrated to; "
            "pick a method whose rule is a mean")
    ints = [e.key for e in algo.entries if e.key in set(algo.uploaded_keys) and not e.dtype.is_floating_point]
    if ints:
        return "an integer upload", (f"{FLAG}: --algo {name} uploads {ints[0]}, not a floating-point entry, which "
                                     "cannot take noise")
    return None


class ClientLevelDP(Privacy):
    """The mechanism of one run (:data:`~mpifl.plan.config.RUN_OPTIONS` group "Client-level differential
    privacy"), the same object on every rank."""

    steps_without_clients = True  # the noise moves the model in a round that sampled nobody

    def __init__(self, cfg: RunConfig, algo: Algorithm, training_clients: int, exchanges: list[TensorSpec | None]):
        refused = refusal(algo, exchanges)
        if refused:
            raise MpiflError(refused[1])
        accountant.opacus(FLAG)
        self.cfg, self.algo = cfg, algo
        self.local = cfg.dp_mode == "local"
        self.adaptive = cfg.dp_clipping == "adaptive"
        self.rate = 1.0 if self.local else cfg.fraction  # local: no amplification, rank 0 sees who uploads
        self.expected = cfg.fraction * training_clients  # m
        self.delta = cfg.dp_delta
        self.noise = cfg.dp_noise  # z, the mechanism's multiplier (resolved by resolve_noise)
        self.count_noise = cfg.dp_count_noise or self.expected / 20  # sigma_b
        self.update_noise = self.noise  # z_Delta
        if self.adaptive and not self.local:
            if self.noise >= 2 * self.count_noise:
                raise MpiflError(f"--dp-clipping adaptive: the count's noise sigma_b = {self.count_noise:g} must "
                                 f"exceed z/2 = {self.noise / 2:g} (--dp-noise, or what --dp-epsilon needs), else no "
                                 "noise is left for the update (Andrew et al., Theorem 1); raise --dp-count-noise or "
                                 "--fraction, or use --dp-clipping fixed")
            self.update_noise = (self.noise ** -2 - (2 * self.count_noise) ** -2) ** -0.5
        self.variances = {e.key for e in algo.entries if e.attr == "running_var"}

    @property
    def keys(self) -> list[str]:
        """The uploaded model entries of the method's current stage: the update (FixBN stops sending BN statistics
        after its first stage)."""
        return self.algo.uploaded_keys

    # ------------------------------------------------------------------ the wire
    def policy(self, policy: SharePolicy) -> SharePolicy:
        """The method's manifest, with C sent down and, under adaptive clipping, b_k sent up."""
        down = policy.download + [TensorSpec(CLIP, (1,), torch.float64)]
        up = policy.upload + ([TensorSpec(UNCLIPPED, (1,), torch.float32)] if self.adaptive else [])
        return SharePolicy(download=down, upload=up, private=policy.private, gathered=policy.gathered)

    def covers(self, spec: TensorSpec, direction: str) -> str:
        if direction == "down":
            return "covered: released after the noise"
        if spec.name in self.keys:
            return "covered: clipped, " + ("noised by the client" if self.local else "noised in the sum")
        if spec.name == UNCLIPPED:
            return "covered: noised in the count" if not self.local else "not covered: one bit, sent as it is"
        return "not covered"

    # ------------------------------------------------------------------ a client's host rank
    @torch.no_grad()
    def privatize(self, upload: dict[str, torch.Tensor], download: dict[str, torch.Tensor], client: int,
                  round_index: int) -> dict[str, torch.Tensor]:
        """The clipped update Delta_k min(1, C/||Delta_k||) in place of the uploaded entries (and, local, its
        noise; adaptive, b_k)."""
        clip = float(download[CLIP][0])
        deltas = torch._foreach_sub([upload[k] for k in self.keys], [download[k] for k in self.keys])
        norms = torch.stack([torch.linalg.vector_norm(d, dtype=torch.float64) for d in deltas])
        norm = float(torch.linalg.vector_norm(norms))  # one wait for the device, whatever the entries
        if norm > clip:
            torch._foreach_mul_(deltas, clip / norm * MARGIN)
        if self.local:
            generator = dp_client_generator(self.cfg.seed, client, round_index, deltas[0].device)
            for d in deltas:
                noise = torch.randn(d.shape, generator=generator, device=d.device, dtype=d.dtype)
                d.add_(noise, alpha=self.noise * clip)
        out = dict(upload)
        out.update(zip(self.keys, deltas))
        if self.adaptive:
            out[UNCLIPPED] = torch.tensor([float(norm <= clip)], dtype=torch.float32, device=deltas[0].device)
        return out

    # ------------------------------------------------------------------ rank 0
    def init_server(self, state: ServerState) -> None:
        state.extra[CLIP] = torch.tensor([self.cfg.dp_clip], dtype=torch.float64)
        state.extra[HISTORY] = accountant.history_tensor([])
        if self.local:
            state.extra[PARTICIPATIONS] = torch.zeros(len(self.algo.training_ids), dtype=torch.float64)

    def download(self, state: ServerState) -> dict[str, torch.Tensor]:
        return {CLIP: state.extra[CLIP]}

    def reductions(self, reductions: dict[str, Reduction], clients: np.ndarray) -> dict[str, Reduction]:
        """Every uploaded entry's sum_k Delta_k / m (fixed weights), and sum_k b_k."""
        fixed = {key: Reduction(key, np.full(len(clients), 1.0 / self.expected)) for key in self.keys}
        if self.adaptive:
            fixed[UNCLIPPED] = Reduction(UNCLIPPED, np.ones(len(clients)))
        return fixed

    def release(self, state: ServerState, sums: dict[str, np.ndarray], clients: np.ndarray, round_index: int) -> None:
        """The sums become the released mean theta + (sum Delta + noise) / m (in place, float64), C moves, and the
        accountant takes the round."""
        clip = float(state.extra[CLIP][0])
        rng = dp_noise_rng(self.cfg.seed, round_index)
        scale = 0.0 if self.local else self.update_noise * clip / self.expected
        for key in self.keys:
            total = sums.setdefault(key, np.zeros(state.model[key].shape))  # a round no client took part in
            if scale:
                noise = rng.standard_normal(total.shape)
                noise *= scale
                total += noise
            total += state.model[key].numpy()  # float32 widened exactly, then added: float64(theta) + the sum
        for key in self.variances.intersection(self.keys):  # noise may push a variance below 0: clamped
            np.maximum(sums[key], 0.0, out=sums[key])  # (post-processing)
        if self.adaptive:
            count = float(sums.get(UNCLIPPED, np.zeros(1))[0])
            if not self.local:
                count += rng.standard_normal() * self.count_noise
            state.extra[CLIP] = torch.tensor([clip * math.exp(-self.cfg.dp_clip_lr * (count / self.expected
                                                                                      - self.cfg.dp_quantile))],
                                             dtype=torch.float64)
        history = accountant.history_of(state.extra[HISTORY])
        if self.local:
            index = np.searchsorted(self.algo.training_ids, clients)
            state.extra[PARTICIPATIONS][index] += 1
            steps = int(state.extra[PARTICIPATIONS].max())
            history = [(self.noise / 2, 1.0, steps)] if steps else []
        else:
            history = accountant.add_step(history, self.noise, self.rate)
        state.extra[HISTORY] = accountant.history_tensor(history)

    def record(self, state: ServerState) -> dict:
        """The guarantee so far, for ``metrics.jsonl``: epsilon at delta, z, C of the next round."""
        history = accountant.history_of(state.extra[HISTORY])
        return {"epsilon": accountant.epsilon(history, self.delta, FLAG), "delta": self.delta,
                "noise_multiplier": self.noise, "clip": float(state.extra[CLIP][0]), "mode": self.cfg.dp_mode}

    def describe(self) -> str:
        """log.txt's line."""
        where = ("each client adds the noise (local)" if self.local else "rank 0 adds the noise (central)")
        return (f"client-level DP: clip {self.cfg.dp_clip:g} ({self.cfg.dp_clipping}), noise multiplier "
                f"{self.noise:g}, {where}; Poisson sampling at q = {self.cfg.fraction:g} of "
                f"{len(self.algo.training_ids)} clients (m = {self.expected:g}); epsilon after {self.cfg.rounds} "
                f"rounds {self.cfg.dp_epsilon:.4g} at delta {self.delta:.3g} (Opacus RDP accountant)")


def resolve_noise(cfg: RunConfig, training_clients: int) -> None:
    """Fill in what the options leave open, once, before config.json is written: delta (1/N), and z from
    ``--dp-epsilon`` (the least noise whose epsilon after ``--rounds`` is at most E) or the epsilon ``--dp-noise``
    reaches after ``--rounds``, so that config.json holds the run's (z, epsilon, delta).  A noise that passes the
    epsilon given (a resumed run with more rounds) is one line."""
    if cfg.dp_delta is None:
        cfg.dp_delta = 1.0 / training_clients
    local = cfg.dp_mode == "local"
    rate, z_scale = (1.0, 0.5) if local else (cfg.fraction, 1.0)
    if cfg.dp_noise is None:
        cfg.dp_noise = accountant.noise_for(cfg.dp_epsilon, cfg.dp_delta, rate, cfg.rounds, FLAG) / z_scale
    reached = accountant.epsilon([(cfg.dp_noise * z_scale, rate, cfg.rounds)], cfg.dp_delta, FLAG)
    if cfg.dp_epsilon is not None and reached > cfg.dp_epsilon:
        raise MpiflError(f"--dp-noise {cfg.dp_noise:g} reaches epsilon {reached:.4g} after {cfg.rounds} rounds, past "
                         f"--dp-epsilon {cfg.dp_epsilon:g}, the budget of the run: give fewer --rounds, or a larger "
                         "--dp-epsilon in a new run")
    cfg.dp_epsilon = reached
