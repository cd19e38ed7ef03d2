"""What every rank derives identically from the configuration, without talking.

The dataset manifest, the logical clients, their placement on ranks, the
seeded initial model, the algorithm and its wire layouts, the input
normalization, and the one-time exchanges.  Every rank builds the same
:class:`Session`; only the bytes of each round travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
from torch import nn

from ..algorithms import Algorithm, Reduction, ServerState, Uploads, get_algorithm
from ..algorithms.core.deltas import local_steps
from ..algorithms.core.guide import check_guide
from ..data import DatasetManifest, open_shard
from ..errors import MpiflError
from ..models import PretrainedLoad, load_pretrained, state_entries
from ..plan.clients import SPLITS, ClientSpec, make_clients
from ..plan.clock import AsyncClock, Fate, SyncClock, Work, plain_fate
from ..plan.config import RunConfig
from ..plan.normalize import InputNormalization, check_input_norm, resolve_input_norm
from ..plan.placement import place_clients
from ..plan.profiles import client_profiles
from ..plan.seeding import participants, seed_model_init
from ..plan.task import task_of
from ..privacy import Privacy, privacy_of
from ..privacy.accountant import opacus
from ..privacy.secure import SecureAggregation
from ..transport.exchange import OneTimeExchange
from ..transport.messages import Messages
from .evaluation import EvalPlan, plan_evaluation


@dataclass
class Session:
    cfg: RunConfig
    manifest: DatasetManifest
    clients: list[ClientSpec]
    placement: list[list[int]]  # client ids hosted by rank h+1
    algo: Algorithm
    initial: dict[str, torch.Tensor]  # seeded initial model state, identical on every rank
    inputs: InputNormalization  # --aug: how clients normalize their images
    pretrained: PretrainedLoad | None = None  # what --pretrained loaded into the initial model
    privacy: Privacy = field(default_factory=Privacy)  # the run's privacy mechanism (mpifl.privacy)
    _messages: dict[int, Messages] = field(default_factory=dict)
    _evaluations: dict[int, EvalPlan] = field(default_factory=dict)
    _client_bytes: dict[int, tuple[int, int]] = field(default_factory=dict)

    def messages(self) -> Messages:
        """Wire layouts of the algorithm's current phase (built once per phase)."""
        phase = self.algo.phase
        if phase not in self._messages:
            messages = Messages(self.policy(), self.evaluation().personal_kinds)
            self._messages[phase] = (self.secure.messages(messages, self.planned(1)) if self.secure else messages)
        return self._messages[phase]

    def policy(self):
        """The wire manifest of the algorithm's current phase, with the privacy mechanism's tensors."""
        return self.privacy.policy(self.algo.policy())

    def evaluation(self) -> EvalPlan:
        """Who evaluates what in the algorithm's current phase (built once per phase)."""
        phase = self.algo.phase
        if phase not in self._evaluations:
            image_bytes = int(np.prod(self.manifest.image_size)) * self.manifest.channels
            self._evaluations[phase] = plan_evaluation(self.clients, self.placement, self.algo, self.cfg, image_bytes)
        return self._evaluations[phase]

    @property
    def exchanges(self) -> list[OneTimeExchange]:
        """The one-time exchanges before round 1, in order: input statistics (FedRDN), then the method's.
        Normalized inputs exist once the first is done, so the method may contribute data-derived tensors."""
        return [self.inputs, self.algo] + ([self.secure] if self.secure else [])

    @cached_property
    def secure(self) -> SecureAggregation | None:
        """``--secure-aggregation``'s masking, None without it; its pairwise keys are agreed in the last one-time
        exchange."""
        if not self.cfg.secure_aggregation:
            return None
        planned = self.planned(1)
        if self.cfg.dp_clip:  # Poisson sampling draws each round's count: a round of one client would show it
            counts = [len(self.sampled(r)) for r in range(1, self.cfg.rounds + 1)]
            if 1 in counts:
                raise MpiflError(f"--secure-aggregation: round {counts.index(1) + 1} of this run's Poisson sample "
                                 "(--dp-clip) has a single client, whose masked upload would be its upload; raise "
                                 "--fraction, or give another --seed")
            planned = self.planned(1 + int(np.argmax(counts)))
        return SecureAggregation(self.cfg, self.algo, self.training_ids, planned, self.reductions)

    def reductions(self, server: ServerState, uploads: Uploads) -> dict[str, Reduction]:
        """The round's sums: the method's (:meth:`Algorithm.reductions`), as the privacy mechanism makes them; rank 0
        folds them, and under secure aggregation each client weighs its terms by them (with a server state it
        cannot read)."""
        return self.privacy.reductions(self.algo.reductions(server, uploads), uploads.clients)

    def planned(self, round_index: int) -> Uploads:
        """What round ``round_index``'s plan says of its uploads (:meth:`Uploads.planned`)."""
        fate = self.fate(round_index)
        return Uploads.planned(self.clients, fate.uploads, fate.staleness)

    def fate(self, round_index: int) -> Fate:
        """Message ``round_index``'s clients under the simulated conditions (:mod:`mpifl.plan.clock`): who trains,
        how far, whose uploads arrive; without conditions, every sampled client trains and uploads."""
        return self.clock.fate(round_index) if self.clock else plain_fate(self.sampled(round_index))

    @cached_property
    def clock(self) -> SyncClock | AsyncClock | None:
        """The simulated clock (docs/clients.md), None when the run simulates no client conditions."""
        cfg = self.cfg
        if not (cfg.simulates_clients or self.algo.asynchronous):
            return None
        profiles = client_profiles(cfg.client_speed, cfg.client_bandwidth, cfg.client_upload, cfg.availability,
                                   cfg.client_trace, cfg.seed, self.clients, self.manifest.domains)
        steps = np.array([local_steps(c.num_train, cfg.batch_size, self.algo.local_epochs()) if c.trains else 0
                          for c in self.clients], dtype=np.int64)
        work = Work(self.training_ids, steps, cfg.batch_size, self.client_bytes)
        if self.algo.asynchronous:
            concurrency, buffer = self.algo.concurrency()
            return AsyncClock(profiles, work, cfg.seed, concurrency, buffer, cfg.drop_after)
        return SyncClock(profiles, work, cfg.seed, cfg.fraction, over_select=cfg.over_select, deadline=cfg.deadline,
                         late=cfg.late, drop_before=cfg.drop_before, drop_after=cfg.drop_after,
                         poisson=cfg.dp_clip > 0)

    def client_bytes(self, round_index: int) -> tuple[int, int]:
        """(download, upload) bytes of one client in round ``round_index``: its stage's wire manifest."""
        phase = self.algo.phase_of(round_index)
        if phase not in self._client_bytes:
            current, self.algo.phase = self.algo.phase, phase
            try:
                policy = self.policy()
            finally:
                self.algo.phase = current
            self._client_bytes[phase] = (sum(s.nbytes for s in policy.download), sum(s.nbytes for s in policy.upload))
        return self._client_bytes[phase]

    def build_model(self) -> nn.Module:
        return _model(self.cfg, self.manifest, type(self.algo))

    @cached_property
    def training_ids(self) -> np.ndarray:
        """Clients that train (all but a held-out domain's), ascending."""
        return np.array([c.id for c in self.clients if c.trains], dtype=np.int64)

    def sampled(self, round_index: int) -> np.ndarray:
        """The round's participants: a seeded sample of the training clients, ascending (Poisson sampling under a
        privacy mechanism whose accounting assumes it)."""
        return self.training_ids[participants(self.cfg.seed, round_index, len(self.training_ids), self.cfg.fraction,
                                              poisson=self.cfg.dp_clip > 0)]

    @cached_property
    def domain_of(self) -> dict[int, str]:
        return {c.id: c.domain for c in self.clients}

    @cached_property
    def trainers_by_rank(self) -> list[list[int]]:
        """The training clients each client rank hosts, ascending ids."""
        return [[c for c in hosted if self.clients[c].trains] for hosted in self.placement]

    @property
    def source_domains(self) -> list[str]:
        return [d for d in self.manifest.domains if d != self.cfg.holdout]


def make_session(cfg: RunConfig, manifest: DatasetManifest, num_hosts: int, labels: dict | None = None) -> Session:
    """``labels``: every domain's labels per split, needed for ``--dirichlet`` only (see :func:`read_labels`)."""
    clients = make_clients(manifest, cfg.clients_per_domain, cfg.seed, cfg.holdout, num_clients=cfg.num_clients,
                           dirichlet=cfg.dirichlet, samples_per_client=cfg.samples_per_client, percent=cfg.percent, labels=labels)
    for client in clients:
        if client.trains and client.num_train == 0:
            shared = sum(1 for c in clients if c.domain == client.domain)
            cause = f"raise --dirichlet (now {cfg.dirichlet}) or " if cfg.dirichlet else ""
            raise MpiflError(f"client {client.id} of domain {client.domain} gets none of the domain's "
                             f"{manifest.split_sizes(client.domain)['train']} training images, split among {shared} "
                             f"clients; {cause}give the domain fewer clients (--clients-per-domain, --num-clients)")
    cfg.input_norm = resolve_input_norm(cfg.input_norm, cfg.pretrained)  # a RunConfig built in code, too
    check_input_norm(cfg.input_norm, manifest)
    algo_cls = get_algorithm(cfg.algo)
    task = task_of(manifest.task, cfg.seg_loss)
    algo_cls.check_task(cfg, task)
    seed_model_init(cfg.seed)
    model = _model(cfg, manifest, algo_cls)
    pretrained = load_pretrained(model, cfg.pretrained) if cfg.pretrained else None
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    algo = algo_cls(cfg, state_entries(model))
    algo.bind_clients(clients)
    algo.bind_task(task)
    check_guide(algo)
    if cfg.dpsgd_clip:
        _check_dp_sgd(cfg, algo, model, clients, manifest)
    if cfg.holdout is not None and "global" not in algo.evaluates:
        raise MpiflError(f"--holdout needs a method with a global model; {cfg.algo} evaluates personal models only "
                         "(its private layers do not exist for an unseen domain); drop --holdout or pick another "
                         "--algo")
    _check_conditions(cfg, algo)
    placement = place_clients([c.num_train for c in clients], max(num_hosts, 1))
    inputs = InputNormalization(cfg.aug, cfg.aug_draw, manifest.channels, cfg.aug_stats, cfg.seed)
    privacy = privacy_of(cfg, algo, [inputs.setup_exchange(), algo.setup_exchange()])
    session = Session(cfg=cfg, manifest=manifest, clients=clients, placement=placement, algo=algo, initial=initial,
                      inputs=inputs, pretrained=pretrained, privacy=privacy)
    session.secure  # a method secure aggregation cannot serve is refused here, before the run writes anything
    if session.clock:  # bad profiles, a trace's bad row: refused here too; and the first round's fate is drawn
        session.fate(1)
    return session


def _check_conditions(cfg: RunConfig, algo: Algorithm) -> None:
    """The simulated client conditions (docs/clients.md) this run's method and privacy options can serve, in one
    line each: a privacy mechanism's accounting (client-level DP's Poisson sampling, DP-SGD's planned steps) and
    secure aggregation's masks assume that every sampled client trains and uploads; an asynchronous method
    samples by its concurrency, with no rounds to set a deadline on."""
    losing = [flag for flag, given in ((f"--algo {algo.name}", algo.asynchronous), ("--availability", cfg.availability),
                                       ("--client-trace", cfg.client_trace), ("--deadline", cfg.deadline),
                                       ("--over-select", cfg.over_select > 1), ("--drop-before", cfg.drop_before),
                                       ("--drop-after", cfg.drop_after)) if given]
    private = [flag for flag, given in (("--dp-clip", cfg.dp_clip), ("--dpsgd-clip", cfg.dpsgd_clip),
                                        ("--secure-aggregation", cfg.secure_aggregation)) if given]
    if losing and private:
        fix = ("pick a synchronous method (--algo fedwon, fedavg-gn, fedavg ...)" if algo.asynchronous else
               "drop one of them (--client-speed and --client-bandwidth may stay)")
        raise MpiflError(f"{private[0]}: {losing[0]} lets sampled clients go missing, and the guarantee assumes "
                         "every sampled client trains and uploads (the accountants' sampling, masks that cancel only "
                         f"in the full sum); {fix}")
    if algo.asynchronous:
        for flag, given in (("--deadline", cfg.deadline), ("--over-select", cfg.over_select > 1),
                            ("--drop-before", cfg.drop_before)):
            if given:
                raise MpiflError(f"{flag}: {algo.name} aggregates asynchronously, with no rounds to sample or wait "
                                 "for (its --concurrency sets how many clients train at once); drop it, and use "
                                 "--availability or --drop-after for clients that are away or lose their upload")


def _check_dp_sgd(cfg: RunConfig, algo: Algorithm, model: nn.Module, clients: list[ClientSpec],
                  manifest: DatasetManifest) -> None:
    """``--dpsgd-clip``: Opacus is installed (one line naming the extra), and DP-SGD protects the run
    (:func:`mpifl.privacy.dp_sgd.check`)."""
    opacus("--dpsgd-clip")
    from ..privacy import dp_sgd  # it imports Opacus at its top

    dp_sgd.check(cfg, algo, model, clients, int(np.prod(manifest.image_size)) * manifest.channels)


def read_labels(cfg: RunConfig, manifest: DatasetManifest) -> dict | None:
    """Labels of every domain and split when ``--dirichlet`` needs them (rank 0 reads, then broadcasts)."""
    if not cfg.dirichlet:
        return None
    if manifest.task != "classification":
        raise MpiflError(f"--dirichlet splits each domain by its images' classes; {manifest.name} is a {manifest.task} "
                         "dataset (masks, not a class per image): drop --dirichlet")
    out = {}
    for domain in manifest.domains:
        with open_shard(cfg.data_root, manifest, domain) as shard:
            out[domain] = {split: shard.labels(split) for split in SPLITS}
    return out


def _model(cfg: RunConfig, manifest: DatasetManifest, algo_cls: type[Algorithm]) -> nn.Module:
    """The run's network, with the normalization (``--norm`` or the method's) and convolution it asks for."""
    outputs = task_of(manifest.task, cfg.seg_loss).outputs(manifest.num_classes)  # sigmoid-dice: no background
    return algo_cls.network(cfg, num_classes=outputs, in_channels=manifest.channels,
                            image_size=tuple(manifest.image_size))
