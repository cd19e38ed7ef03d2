"""Record-level differential privacy inside each client: DP-SGD (Abadi et al., "Deep Learning with Differential
Privacy", CCS 2016), with Opacus (Yousefpour et al., "Opacus: User-Friendly Differential Privacy Library in
PyTorch", 2021).  On with ``--dpsgd-clip C > 0``.

A client with n training records and batch size B takes, every local epoch, ceil(n / B) steps of:

1. **Poisson sampling**: the batch L_t holds each record independently with probability q = min(1, B / n), drawn
   from the client's seeded generator (:func:`~mpifl.plan.seeding.client_rng`), so it may be empty
   (:meth:`~mpifl.client.client_data.ClientData.sampled_batch`); the accountant's analysis is of this sampling;
2. **per-record gradients** g_i, i in L_t, of the method's batch loss (Opacus' ``GradSampleHooks``: its rule per
   layer kind, functorch's vmap for any other layer, e.g. FedWon's ``WSConv2d``);
3. **clipping**: g_i <- g_i min(1, C / (||g_i||_2 + 1e-6)), the norm over every trainable parameter (Opacus'
   ``DPOptimizer``, flat clipping);
4. **noise**: g = (sum_i g_i + N(0, sigma^2 C^2 I)) / (q n), the noise from a torch generator seeded by
   (seed, client, round) (:func:`~mpifl.plan.seeding.noise_seed`), divided by the expected batch size (Opacus'
   "mean" reduction); Opacus' default ``secure_mode=False``: torch's normal sampler, not hardened against
   floating-point attacks on the noise;
5. then, as post-processing of g, which costs no privacy: the method's ``after_backward`` (FedProx's proximal
   term, SCAFFOLD's control variates, FedWon's adaptive gradient clipping, which thus clips the noised mean
   gradient unit-wise against the weights), ``--max-grad-norm`` and the optimizer's step.

**Accounting.**  Each client's RDP accountant (Opacus' ``RDPAccountant``: the sampled Gaussian mechanism's Renyi
DP, Mironov et al. 2019, at Opacus' default orders, converted to (epsilon, delta)) holds its history (sigma, q,
steps); it lives in the client's private state as float64 rows under :data:`HISTORY`, so checkpoints carry it and a
resumed run continues the same epsilon.  delta is ``--dpsgd-delta``, or 1 / n.  sigma is ``--dpsgd-noise``, or
calibrated per client with Opacus' ``get_noise_multiplier`` so that its epsilon after the run's planned steps (the
rounds up to ``--schedule-rounds`` it is sampled in, times its local epochs, times ceil(n / B)) is at most
``--dpsgd-epsilon`` (within 1 %).  The guarantee covers the method's uploads over the whole run: they are
post-processing of the client's DP-SGD steps and of what it received, and the accountant composes the steps of all
its rounds (RDP composes adaptively).  It does not cover the simulator's monitoring: the training loss, accuracy and
records seen that each client reports for ``metrics.jsonl`` (``client.meta``) are not privatized.

**What is refused** (:func:`check`, one line at set-up): models with batch statistics (BatchNorm and any norm with
running statistics mix a batch's records and keep a statistic of them); a method with its own loss
(``batch_loss``, ``extra_loss``: it may couple a batch's records or differentiate inside the forward pass), its own
layers (``adapt_model``: they may mix records, as MixStyle's statistics do), a fine-tuning on the training records
outside the accounted steps (``personalize``), or tensors computed from the clients' data that leave the client
(data-derived uploads, one-time exchanges); ``--aug`` with client statistics; fp16/bf16 and ``--compile``; clients
whose images stream.  ``--input-norm``'s constants (the dataset build's pooled or per-domain statistics, or fixed
ones) are taken as public, as DP training usually takes a dataset's normalization.
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

import numpy as np
import torch
from opacus.accountants import RDPAccountant
from opacus.grad_sample import GradSampleHooks
from opacus.optimizers import DPOptimizer
from opacus.utils.module_utils import trainable_modules
from torch import nn

from ..algorithms import Algorithm, ClientState
from ..errors import MpiflError
from ..plan.batches import streams
from ..plan.clients import ClientSpec
from ..plan.config import RunConfig
from ..plan.seeding import noise_seed, participants
from . import accountant

# the first layer's input takes no gradient, so torch warns that its full backward hook sees only the output's,
# which is all Opacus' per-record rules read
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to "
                        "module outputs")
FLAG = "--dpsgd-clip"
HISTORY = "dpsgd/history"  # private state: the accountant's (sigma, q, steps) rows, float64
ALTERNATIVES = ("--algo fedwon (normalization-free), fedavg-gn or fedavg-ln, or a --norm without running statistics "
                "(gn, ln, none)")
#: hooks a method may not override under DP-SGD, and why (module docstring)
REFUSED_HOOKS = (
    ("batch_loss", "trains on a loss of its own (batch_loss), which may couple a batch's records or differentiate "
                   "inside the forward pass, so per-record clipping would not bound one record's influence"),
    ("extra_loss", "adds a loss term of its own (extra_loss), which may couple a batch's records"),
    ("adapt_model", "inserts layers of its own (adapt_model), which may mix records across a batch"),
    ("personalize", "fine-tunes on the training records before evaluating (personalize), steps the accountant "
                    "does not count"),
)


def sample_rate(num_train: int, batch_size: int) -> float:
    """q = min(1, B / n): the probability that a step's batch holds a given record."""
    return min(1.0, batch_size / num_train)


def steps_per_epoch(num_train: int, batch_size: int) -> int:
    return math.ceil(num_train / batch_size)


def delta_of(cfg: RunConfig, num_train: int) -> float:
    return cfg.dpsgd_delta or 1.0 / num_train


def planned_steps(cfg: RunConfig, algo: Algorithm, spec: ClientSpec) -> int:
    """The steps a client takes up to round ``--schedule-rounds`` (:attr:`RunConfig.horizon`)."""
    rounds = _rounds_sampled(cfg.seed, len(algo.training_ids), cfg.fraction, cfg.horizon, cfg.dp_clip > 0)
    return (rounds[algo.training_ids.index(spec.id)] * algo.local_epochs()
            * steps_per_epoch(spec.num_train, cfg.batch_size))


@lru_cache(maxsize=8)
def _rounds_sampled(seed: int, clients: int, fraction: float, horizon: int, poisson: bool) -> np.ndarray:
    """Per training client (by position), the rounds 1..horizon it is sampled in (as the session samples them)."""
    counts = np.zeros(clients, dtype=np.int64)
    for r in range(1, horizon + 1):
        counts[participants(seed, r, clients, fraction, poisson)] += 1
    return counts


def noise_multiplier(cfg: RunConfig, algo: Algorithm, spec: ClientSpec) -> float:
    """sigma: ``--dpsgd-noise``, or calibrated to ``--dpsgd-epsilon`` over the client's planned steps."""
    if cfg.dpsgd_noise:
        return cfg.dpsgd_noise
    # a client sampled in no round up to the horizon is calibrated for one step (it trains only beyond it)
    return accountant.noise_for(cfg.dpsgd_epsilon, delta_of(cfg, spec.num_train),
                                sample_rate(spec.num_train, cfg.batch_size), max(1, planned_steps(cfg, algo, spec)),
                                FLAG)


def _accountant(rows: list[tuple[float, float, int]]) -> RDPAccountant:
    """Opacus' RDP accountant with the history ``rows`` of (sigma, q, steps)."""
    rdp = RDPAccountant()
    if rows:
        rdp.load_state_dict({"history": list(rows), "mechanism": rdp.mechanism()})
    return rdp


class DpSgd:
    """One client's DP-SGD over one round of local training on ``model`` with ``optimizer`` (module docstring): the
    loop draws its batches from :meth:`epoch`, clears with ``self.optimizer.zero_grad``, calls :meth:`privatize`
    after ``backward()`` and before the method's gradient hooks, and :meth:`finish` at the end."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, algo: Algorithm, client: ClientState,
                 round_index: int):
        cfg, n = algo.cfg, client.spec.num_train
        self.client, self.rate, self.steps = client, sample_rate(n, cfg.batch_size), steps_per_epoch(n, cfg.batch_size)
        self.sigma, self.delta = noise_multiplier(cfg, algo, client.spec), delta_of(cfg, n)
        self.model, self.hooks, self.hooked = model, None, None
        device = next(model.parameters()).device
        generator = torch.Generator(device=device)
        generator.manual_seed(noise_seed(cfg.seed, client.id, round_index))
        self.optimizer = DPOptimizer(optimizer, noise_multiplier=self.sigma, max_grad_norm=cfg.dpsgd_clip,
                                     expected_batch_size=round(self.rate * n), loss_reduction="mean",
                                     generator=generator)
        kept = client.private.get(HISTORY)
        self.accountant = _accountant([] if kept is None else [(sigma, rate, int(steps))
                                                               for sigma, rate, steps in kept.tolist()])
        self._hook()

    def epoch(self, data, rng: np.random.Generator):
        """One epoch's Poisson batches; an empty draw is an empty batch (the step adds noise alone)."""
        self._hook()
        for _ in range(self.steps):
            yield data.sampled_batch(rng, self.rate)

    def _hook(self) -> None:
        """Opacus' hooks on the layers whose parameters train this epoch, again whenever a method's freezing rule
        (``trainable``, FedRep's) changes them: a frozen layer behind a trained one must not have any."""
        trains = [p.requires_grad for p in self.model.parameters()]
        if trains != self.hooked:
            if self.hooks is not None:
                self.hooks.cleanup()
            self.hooks, self.hooked = GradSampleHooks(self.model, batch_first=True, loss_reduction="mean"), trains
            for p in self.optimizer.params:
                p.summed_grad = None

    def privatize(self, empty: bool) -> None:
        """Per-record gradients -> clipped, summed, noised, divided by the expected batch size, into ``.grad``."""
        if empty:
            for p in self.optimizer.params:
                p.grad_sample = p.new_zeros((0, *p.shape))
        self.optimizer.pre_step()
        self.accountant.step(noise_multiplier=self.sigma, sample_rate=self.rate)

    def finish(self) -> float:
        """Remove the hooks, keep the accountant's history in the client's private state; the client's epsilon."""
        self.hooks.cleanup()
        for p in self.optimizer.params:
            p.summed_grad = None
        rows = self.accountant.state_dict()["history"]
        self.client.private[HISTORY] = torch.tensor(rows, dtype=torch.float64)
        return accountant.epsilon(rows, self.delta, FLAG)


def check(cfg: RunConfig, algo: Algorithm, model: nn.Module, clients: list[ClientSpec], image_bytes: int) -> None:
    """One line, at set-up, for a run with ``--dpsgd-clip`` that DP-SGD cannot protect (module docstring)."""
    method = type(algo)
    for hook, why in REFUSED_HOOKS:
        if next(k for k in method.__mro__ if hook in k.__dict__) is not Algorithm:
            _refuse(f"--algo {algo.name} {why}")
    spec = algo.setup_exchange()
    derived = ([f"shares {spec.name} before round 1"] if spec is not None else []) + [
        f"uploads {s.name} ({s.derived})" for s in algo.policy().upload if s.derived and not _is_statistic(s.name)]
    if derived:
        _refuse(f"--algo {algo.name} {derived[0]}, computed from its clients' data outside DP-SGD")
    statistics = [name for name, _ in model.named_buffers() if _is_statistic(name)]
    if statistics:
        _refuse(f"the model keeps batch statistics ({statistics[0]} ...), which mix a batch's records and are a "
                f"statistic of them")
    buffered = [(name, layer) for name, layer in trainable_modules(model) if next(layer.buffers(), None) is not None]
    if buffered:  # Opacus' GradSampleHooks.validate's rule
        name, layer = buffered[0]
        _refuse(f"Opacus cannot take per-record gradients of {name} ({type(layer).__name__}), a trained layer that "
                "holds buffers")
    if cfg.aug != "none":
        shared = " and shares them" if cfg.aug.startswith("fedrdn") else ""
        raise MpiflError(f"--dpsgd-clip: --aug {cfg.aug} normalizes each client's images by statistics of its "
                         f"records{shared}, outside DP-SGD; use --aug none")
    if cfg.precision != "fp32" or cfg.compile:
        raise MpiflError(f"--dpsgd-clip: per-record gradients run in fp32 without torch.compile; drop "
                         f"{'--compile' if cfg.compile else f'--precision {cfg.precision}'}")
    for client in clients:
        if client.trains:
            if streams(client, image_bytes, cfg.stream_above):
                raise MpiflError(f"--dpsgd-clip: client {client.id}'s images would stream from its shard, and "
                                 f"Poisson sampling reads any record at any step; raise --stream-above")
            noise_multiplier(cfg, algo, client)  # a target epsilon no sigma reaches fails here


def _is_statistic(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("running_")


def _refuse(problem: str) -> None:
    raise MpiflError(f"{FLAG}: {problem}; use a method and model DP-SGD supports: {ALTERNATIVES}")
