"""The algorithm interface: what a federated method shares, keeps, trains and aggregates.

A method is a subclass of :class:`Algorithm` that overrides only what differs
from FedAvg.  The runtime owns the loop and calls the method's hooks, which
``Algorithm`` lists grouped by where they run, each group's most overridden
first; what the runtime calls and no method overrides (the share policy's keys
and wire manifest, the network's build, the round's entry) is apart, in
:class:`~mpifl.algorithms.core.helpers.AlgorithmHelpers`.
:data:`mpifl.algorithms.core.hooks.HOOKS` is their contract, one entry per
public method: its role, on which rank the runtime calls it, when, whether an
override must call ``super()``, and whether a method overrides it at all (a
helper) (``tests/algorithms/core/test_hooks.py`` checks it against this class,
the method files and the runtime).  What a method states through them, by role:

* **its local training** (client training): the client hooks from :meth:`begin_local` to
  :meth:`end_local` (optimizer, epochs, freezing, loss, gradient corrections,
  what goes up beyond the model), and per-round schedules (:meth:`begin_round`);
* **the guiding regularizer** (``--guide-lambda``, :mod:`mpifl.algorithms.core.guide`), which every method
  takes: :meth:`begin_local` holds the downloaded classifier, frozen, and :meth:`extra_loss` adds
  lambda L(h_g(features), y), L the task's loss; its default is 0 but gPerXAN's 0.5 (its :attr:`defaults`);
* **its share policy, as data** (upload): which model state entries go down
  (:meth:`shares`) and which of those come back up (:meth:`sends_back`),
  and tensors beyond the model (:meth:`extra_download`, :meth:`extra_upload`,
  :meth:`extra_private`: control variates, statistics ...).
  ``policy`` turns these into the wire manifest; the runtime moves
  exactly those tensors and nothing else.  A method with stages returns its
  stage from :meth:`phase_of`; the rules may read ``self.phase``, and a model
  entry that is sent down but not back is *adopted*: every client stores the
  received value as its own from then on (FixBN freezing BN statistics);
* **the server rule** (server aggregation), as a reduction (:mod:`mpifl.algorithms.core.reduction`): the
  weighted sums it needs of the uploads (:meth:`reductions`), folded as they arrive, the small entries rank 0
  receives from every client whole (:meth:`gathered_keys`), and the new global state from those
  (:meth:`aggregate`);
* **what it evaluates** (evaluation): ``evaluates`` lists "global" (the model rebuilt from
  the download) and/or "personal" (the download plus the client's private
  state, after :meth:`personalize`'s fine-tuning);
* **the model** it needs (set-up): ``norm`` (the normalization layer kind, which
  ``--norm`` overrides unless the method lists the kinds its rule works with
  in ``norms``) and ``conv`` (the convolution kind), see ``mpifl.models.norm``,
  plus the layers it inserts (:meth:`adapt_model`, e.g. MixStyle);
* **a one-time exchange** before round 1, if any (FedMix's mean images), and
  a training set rebuilt from what was received (CCST's stylized images) (set-up).

Private state (every model entry the method does not share, plus
:meth:`extra_private` tensors, plus the optimizer state with
``--keep-optimizer``, :mod:`mpifl.plan.optim`) lives in :class:`ClientState` on the client's
host rank for the whole run and never crosses the wire.  State that must
survive from one round to the next lives in tensors, ``ClientState.private``
on the client side and ``ServerState.extra`` on the server, never in Python
attributes of the method: those two are what a checkpoint saves.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy as np
import torch
from torch import nn

from ...errors import MpiflError
from ...models import StateEntry
from ...plan.clients import ClientSpec
from ...plan.config import Option, RunConfig
from ...plan.optim import build_optimizer
from ...plan.task import CLASSIFICATION, Task
from ...transport.wire import TensorSpec
from .guide import guide_loss, with_guide
from .helpers import AlgorithmHelpers
from .options import GUIDE_LAMBDA, with_defaults
from .reduction import Reduction, mean_weights, weighted_mean
from .state import ClientState, ServerState, Uploads

REGISTRY: dict[str, type["Algorithm"]] = {}  # --algo name -> class, filled as the method files are imported


class Algorithm(AlgorithmHelpers):
    """FedAvg's behaviour; methods override what differs.

    The hooks, by where they run, each group starting with those most methods override:

    1. client training, on a client's host rank every round: :meth:`begin_local`, :meth:`end_local`,
       :meth:`after_backward`, :meth:`batch_loss` ...;
    2. upload, the share policy of a stage: :meth:`shares`, :meth:`extra_upload`, :meth:`extra_download` ...;
    3. server aggregation, on rank 0 every round: :meth:`aggregate`, :meth:`init_server`, :meth:`gathered_keys`,
       :meth:`reductions`, :meth:`download` ...;
    4. evaluation: :meth:`global_model_shared`, :meth:`global_private`, :meth:`personalize` ...;
    5. one-time set-up: :meth:`bind_clients`, :meth:`adapt_model`, :meth:`setup_exchange` ...

    The helpers the runtime calls, which no method overrides, are in
    :class:`~mpifl.algorithms.core.helpers.AlgorithmHelpers`.  A subclass that sets its own ``name`` registers
    itself under it (:data:`REGISTRY`): adding a method is adding its file to ``mpifl/algorithms/``.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    options: ClassVar[tuple[Option, ...]] = ()
    norm: ClassVar[str] = "bn"
    #: the ``--norm`` kinds the method's rule works with (None: any), and why, for the one-line refusal
    norms: ClassVar[tuple[str, ...] | None] = None
    norms_because: ClassVar[str] = ""
    conv: ClassVar[str] = "plain"
    evaluates: ClassVar[tuple[str, ...]] = ("global",)
    selects_by: ClassVar[str] = "val-mean"  # the best-round rule of --select-by auto
    #: the method's rule assumes each round's local optimizer starts from zero state (FedNova's a_K,
    #: ``deltas.solver_norm``), so ``--keep-optimizer`` is refused for it
    fresh_optimizer: ClassVar[bool] = False
    #: the method's own default of an option it takes, by name, where it differs from the option's declared one
    #: (FedAdam: ``{"server_lr": 1e-2}``; :mod:`mpifl.algorithms.core.options`)
    defaults: ClassVar[dict[str, Any]] = {}
    #: why the method's rule needs a class per image ("" for a task-agnostic method): it refuses a segmentation
    #: task with it
    classification_only: ClassVar[str] = ""
    #: :meth:`reductions` reads what training returned (steps taken, :meth:`prepare`'s work on gathered
    #: scores), so rank 0 folds the summed uploads after the gather and a client rank holds its round's
    #: uploads until then.  False: they read only the round's plan (who trains, ``num_samples``), and rank 0
    #: folds each client's upload while the others still train
    reductions_need_results: ClassVar[bool] = False
    #: the method aggregates asynchronously on the simulated clock (:mod:`mpifl.plan.clock`): a message is one
    #: server step, its clients train on the version they downloaded and its uploads are the step's arrivals,
    #: each with its staleness (``Uploads.staleness``); :meth:`concurrency` says how many train at once
    asynchronous: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        """Registers a named method; gives every method ``--guide-lambda``, and its :attr:`defaults` to its options."""
        super().__init_subclass__(**kwargs)
        method = cls.__qualname__
        cls.options = with_defaults(method, with_guide(method, cls.options, cls.defaults), cls.defaults)
        name = cls.__dict__.get("name")
        if name:
            if name in REGISTRY:
                raise TypeError(f"two algorithms named {name!r}: {REGISTRY[name].__qualname__} and {cls.__qualname__}")
            REGISTRY[name] = cls

    def __init__(self, cfg: RunConfig, entries: list[StateEntry]):
        self.check_options(cfg)
        if self.fresh_optimizer and cfg.keep_optimizer:
            raise MpiflError(f"--keep-optimizer: {self.name} divides by the distance K local steps move from a "
                             "fresh optimizer (FedNova's a_K), which kept momentum or Adam moments make wrong; "
                             "drop --keep-optimizer")
        self.cfg = cfg
        self.entries = entries
        self.phase = 0
        self.lr = cfg.lr  # the local learning rate of the round entered (--lr-schedule)
        self._keys: dict[int, dict[str, list[str]]] = {}
        self.training_ids: list[int] = []  # the training clients' ids, ascending, set by bind_clients
        # a RunConfig built in code may leave the option out: the method's default (its options carry its defaults)
        guide = next(o for o in self.options if o.name == GUIDE_LAMBDA.name)
        self.guide_lambda: float = cfg.algo_options.get(guide.name, guide.default)
        self._global_head: nn.Module | None = None  # h_g of the round being trained (guiding regularizer)
        self.task: Task = CLASSIFICATION  # the dataset's (bind_task)

    # ================================================================== 1. client training (its host rank)
    def begin_local(self, client: ClientState, model: nn.Module, download: dict[str, torch.Tensor]) -> None:
        """Called after the client model is rebuilt, before local training.  Default: with ``--guide-lambda``,
        hold the downloaded classifier, frozen (:meth:`hold_global_head`); a method overriding it calls
        ``super()``."""
        self.hold_global_head(model)

    def end_local(self, client: ClientState, model: nn.Module) -> dict[str, torch.Tensor]:
        """The :meth:`extra_upload` tensors after local training (model entries are added by the runtime)."""
        return {}

    def after_backward(self, client: ClientState, model: nn.Module) -> None:
        """Gradient corrections between ``backward()`` and ``optimizer.step()``."""

    def batch_loss(self, client: ClientState, model: nn.Module, x: torch.Tensor,
                   y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(training objective, logits) of one mini-batch: the task's loss (cross-entropy; Dice for segmentation)
        of classifier(encode(x)), + :meth:`extra_loss`."""
        features = model.encode(x)
        logits = model.classifier(features)
        return self.plus_extra(self.task.loss(logits, y), client, model, features, logits, y), logits

    def extra_loss(self, client: ClientState, model: nn.Module, features: torch.Tensor,
                   logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """A term added to the task loss of each mini-batch (None: nothing).  Default: the guiding
        regularizer lambda L(h_g(features), labels), L the task's loss (``self.task.loss``), while a global head
        is held; a method overriding it adds ``super()``'s."""
        if self._global_head is None:
            return None
        return guide_loss(self._global_head, self.guide_lambda, features, labels, self.task)

    def trainable(self, entry: StateEntry, epoch: int) -> bool:
        """Whether parameter ``entry`` trains in local epoch ``epoch`` (from 0) of a round; a frozen one gets no
        gradient, so the optimizer leaves it as it is (no step, no weight decay).  Applied by the local loop
        before every epoch.  Default: every parameter trains."""
        return True

    def begin_round(self, round_index: int) -> None:
        """Per-round schedules (temperatures ...), on every rank."""

    def local_epochs(self) -> int:
        """Local epochs of a round: ``--local-epochs`` (FedRep adds its head epochs)."""
        return self.cfg.local_epochs

    def make_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """A fresh local optimizer at learning rate ``lr`` (the runtime passes the round's :attr:`lr`):
        ``--optimizer`` with ``--momentum``, ``--weight-decay`` (:func:`~mpifl.plan.optim.build_optimizer`).
        With ``--keep-optimizer`` the runtime loads the client's kept state into it, whatever it is."""
        return build_optimizer(model.parameters(), self.cfg, lr)

    def train_mode(self, model: nn.Module) -> None:
        """Put the model in training mode for local training (a method may put layers in eval mode here)."""
        model.train()

    def score_local(self, client: ClientState, model: nn.Module, moment: str, score) -> None:
        """Called twice in a client's round: ``moment`` "downloaded" with the model as loaded, before
        :meth:`begin_local`; "trained" after local training, before :meth:`end_local`.  ``score(split)`` is
        (summed cross-entropy, correct, count) of the model as it is on one of the client's splits ("train",
        "val", "test"), evaluated on demand only (FedDG-GA's generalization gaps).  Default: nothing."""

    # ================================================================== 2. upload: the share policy of a stage
    def shares(self, entry: StateEntry) -> bool:
        """Model state entries that go down (and, unless :meth:`sends_back` says otherwise, come up).

        Default: everything but BN ``num_batches_tracked``, a step counter that
        is meaningless averaged and stays with each client.
        """
        return entry.attr != "num_batches_tracked"

    def extra_upload(self) -> list[TensorSpec]:
        """Tensors beyond the model each participating client sends back."""
        return []

    def extra_download(self) -> list[TensorSpec]:
        """Tensors beyond the model sent to each participating client."""
        return []

    def extra_private(self) -> list[TensorSpec]:
        """Tensors beyond the model each client keeps for itself."""
        return []

    def sends_back(self, entry: StateEntry) -> bool:
        """Among the shared entries, those the clients upload; the others are adopted."""
        return True

    def phase_of(self, round_index: int) -> int:
        """The method's stage in a round; the share policy may differ between stages."""
        return 0

    @property
    def adopted_keys(self) -> list[str]:
        """Model entries sent down but not back: every client keeps the received value as its own."""
        return self._rule("adopted")

    def derived_from_data(self, entry: StateEntry) -> str:
        """What of the client's data a model entry is computed from ("" for parameters): normalization
        layers' running statistics are the mean and variance of its feature maps."""
        if not entry.is_param and entry.attr in ("running_mean", "running_var"):
            return "feature statistics of the clients' data (normalization running mean or variance)"
        return ""

    # ================================================================== 3. server aggregation (rank 0)
    def aggregate(self, server: ServerState, uploads: Uploads) -> None:
        """Every uploaded model entry's global value = :meth:`global_value` of its weighted mean (a gathered
        entry: of the :meth:`combine` of the clients' values)."""
        weights = self.client_weights(uploads)
        for key in self.uploaded_keys:
            combined = (torch.from_numpy(uploads.sums[key]) if key in uploads.sums
                        else self.combine(key, uploads.tensors[key], weights))
            value = self.global_value(server, key, combined, uploads)
            server.model[key] = value.to(server.model[key].dtype)

    def init_server(self, initial: dict[str, torch.Tensor]) -> ServerState:
        return ServerState(model={k: initial[k].clone() for k in self.shared_keys})

    def gathered_keys(self) -> list[str]:
        """Uploads whose every client's value :meth:`prepare`, :meth:`combine` or :meth:`aggregate` reads
        (small tensors: statistics, scores, choices); rank 0 receives them whole, O(clients) bytes.  The
        other uploads reach rank 0 only through :meth:`reductions`.  FedAvg: none."""
        return []

    def reductions(self, server: ServerState, uploads: Uploads) -> dict[str, Reduction]:
        """The weighted sums :meth:`aggregate` reads from ``uploads.sums``, by name.  Unless
        :attr:`reductions_need_results`, this runs at the round's start on the plan alone: ``uploads`` then
        holds the sampled clients and their ``num_samples``, nothing that training returns.  FedAvg: every
        uploaded model entry that is not gathered, under its own name, weighted by :meth:`client_weights`."""
        gathered = set(self.gathered_keys())
        summed = [key for key in self.uploaded_keys if key not in gathered]
        p = mean_weights(self.client_weights(uploads)) if summed else None
        return {key: Reduction(key, p) for key in summed}

    def download(self, server: ServerState) -> dict[str, torch.Tensor]:
        """The tensors of :meth:`policy` ``.download``, from the server state."""
        return {k: server.model[k] for k in self.shared_keys}

    def global_value(self, server: ServerState, key: str, combined: torch.Tensor, uploads: Uploads) -> torch.Tensor:
        """The new global value of one entry from its combined client value; ``server.model[key]`` still
        holds the old one.  FedAvg: the combined value.  Server optimizers (``core.server_opt``: FedAvgM,
        SCAFFOLD's global step; FedDyn) step here."""
        return combined

    def client_weights(self, uploads: Uploads) -> np.ndarray:
        """FedAvg weights: proportional to training samples (McMahan et al., eq. 1)."""
        return uploads.num_samples.astype(np.float64)

    def combine(self, key: str, values: Sequence[np.ndarray], weights: np.ndarray) -> torch.Tensor:
        """A gathered entry's aggregation rule (:meth:`gathered_keys`); FedAvg: the weighted mean (float64,
        client-id order), the same bits as its reduction."""
        return torch.from_numpy(weighted_mean(values, weights))

    def prepare(self, server: ServerState, uploads: Uploads) -> None:
        """After the gather, before :meth:`aggregate` (and before :meth:`reductions` where
        :attr:`reductions_need_results`): ``uploads`` holds the clients' records and gathered entries, no sums
        yet.  FedAvg: nothing."""

    def concurrency(self) -> tuple[int, int]:
        """An asynchronous method's (clients training at once, arrivals per server step); (0, 0) for a synchronous
        one."""
        return 0, 0

    # ================================================================== 4. evaluation
    @property
    def global_model_shared(self) -> bool:
        """Whether every client's global model is one model, so that any rank may score any client's share of
        its evaluation (:mod:`mpifl.session.evaluation`): by default, when the private model entries are only BN
        step counters, which a model in evaluation mode does not read.  A method whose :meth:`global_private`
        replaces its clients' own entries, or whose own entries are the same on every client, says so."""
        return all(key.endswith("num_batches_tracked") for key in self.private_keys)

    def global_private(self, client: ClientState, download: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Values of the unshared model entries when a client evaluates the *global* model.

        Default: the client's own (for FedAvg these are only step counters).
        A method with real private layers and a global evaluation overrides it,
        e.g. with tensors of its download.
        """
        return client.private

    def personalize(self, client: ClientState, model: nn.Module, fit) -> None:
        """Turn the loaded personal model (download + the client's private state) into the one evaluated, on
        the client's rank before each personal evaluation (fine-tuning, e.g. FedBABU).  ``fit(optimizer,
        epochs, trainable=None)`` runs the runtime's local training loop (this method's loss and hooks; its
        :meth:`trainable` unless another rule is given) on the client's training split, seeded by (seed,
        client, round evaluated).  What it changes lasts for this evaluation
        only: the private state is untouched.  Default: evaluate the model as loaded."""

    def begin_eval(self, model: nn.Module, round_index: int) -> None:
        """Called on a client rank before it evaluates the models of round ``round_index``
        (per-round layer settings, e.g. FedNN's temperature, must be those of that round)."""

    @property
    def global_eval_per_batch(self) -> bool:
        """Whether the global model's score of a batch depends on that batch alone.  False for an evaluation that
        draws random numbers in sequence (FedNN's Gumbel draws, seeded once per client): a client's evaluation
        then runs whole, on one rank."""
        return True

    # ================================================================== 5. one-time set-up
    def bind_clients(self, clients: Sequence[ClientSpec]) -> None:
        """The run's logical clients, the same list on every rank; called once when the session is built.

        Sets :attr:`training_ids` (every client but a held-out domain's, in client-id order, the order of
        one-time exchanges), whose number N a server rule defined over all clients, not only a round's
        participants, needs (SCAFFOLD's c, FedDyn's h).
        """
        self.training_ids = sorted(c.id for c in clients if c.trains)

    @classmethod
    def adapt_model(cls, model: nn.Module, cfg: RunConfig) -> nn.Module:
        """The network the method trains, from the one built with its norm kind and ``conv``
        (called once per rank with the seeded model; inserted layers must hold no random state)."""
        return model

    def setup_exchange(self) -> TensorSpec | None:
        """A tensor every training client contributes once, before round 1 (None: no exchange).

        Every rank, the server included, then receives all training clients'
        contributions stacked in client-id order (:meth:`setup_received`).
        ``--show-manifest`` lists it.
        """
        return None

    def setup_contribution(self, client: ClientState, data) -> torch.Tensor:
        """This client's :meth:`setup_exchange` tensor, from its ``ClientData`` (normalized model inputs
        of a split: ``data.eval_batches(split, batch_size)``)."""
        raise NotImplementedError(f"{self.name} declares a setup exchange but no contribution")

    def setup_received(self, everyone: torch.Tensor) -> None:
        """(N_train, *shape): every training client's contribution, on every rank; held until the run ends
        (a resumed run exchanges again)."""

    def training_data(self, clients: dict[int, ClientState], data: dict) -> dict:
        """On a client rank, after the one-time exchanges: its training clients' ``ClientData`` (by id) as they
        train on them for the whole run (a resumed run rebuilds them).  Default: as loaded; CCST trains on
        stylized copies (``ClientData.with_train``)."""
        return data

    @classmethod
    def norm_placement(cls, cfg: RunConfig) -> tuple[str, str]:
        """(where composite norms go, the flag that said it): ``--norm-blocks``
        (:func:`~mpifl.models.place_composite_norms`)."""
        return cfg.norm_blocks, "--norm-blocks"
