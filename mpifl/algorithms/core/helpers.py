"""What the runtime calls on an algorithm and no method overrides: :class:`AlgorithmHelpers`, the base of
:class:`~mpifl.algorithms.core.base.Algorithm`.

They derive from the hooks (``base.py``) what the runtime needs: the share policy's keys and wire manifest, the
round's stage and learning rate, the guiding regularizer's held classifier, the network and the option checks.  A
method calls some of them (``self.shared_keys``, ``self.plus_extra`` ...) and overrides none
(:data:`~mpifl.algorithms.core.hooks.HOOKS` lists them as "helper"; ``tests/algorithms/core/test_hooks.py`` checks
it).  They read the hooks and the class attributes ``Algorithm`` declares.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import MpiflError
from ...models import StateEntry, build_model, place_composite_norms
from ...plan.clients import ClientSpec
from ...plan.config import RunConfig
from ...plan.optim import round_lr
from ...plan.task import Task
from ...transport.share import SharePolicy
from ...transport.wire import TensorSpec
from .guide import frozen_head
from .state import ClientState


class AlgorithmHelpers:
    """The helpers of :class:`~mpifl.algorithms.core.base.Algorithm`, grouped by role as its hooks are."""

    # ------------------------------------------------------------------ client training
    def enter_round(self, round_index: int) -> None:
        """Called by the runtime on every rank before round ``round_index``'s message: the method's stage and
        the round's learning rate :attr:`lr` (:func:`~mpifl.plan.optim.round_lr`), then :meth:`begin_round`."""
        self.phase = self.phase_of(round_index)
        self.lr = round_lr(self.cfg, round_index)
        self.begin_round(round_index)

    def hold_global_head(self, model: nn.Module) -> None:
        """h_g for the round's local training: the model's classifier as loaded, frozen (None when the guide
        is off)."""
        self._global_head = frozen_head(model) if self.guide_lambda else None

    def release_global_head(self) -> None:
        """Called by the runtime when a round's local training is over: later training (a personalization's
        fine-tuning) is not guided."""
        self._global_head = None

    def plus_extra(self, loss: torch.Tensor, client: ClientState, model: nn.Module, features: torch.Tensor,
                   logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``loss`` + :meth:`extra_loss` of the mini-batch (``features``: ``model.encode``'s output)."""
        extra = self.extra_loss(client, model, features, logits, labels)
        return loss if extra is None else loss + extra

    # ------------------------------------------------------------------ upload: the share policy of a stage
    def _rule(self, name: str) -> list[str]:
        if self.phase not in self._keys:
            down = [e for e in self.entries if self.shares(e)]
            self._keys[self.phase] = {
                "shared": [e.key for e in down],
                "uploaded": [e.key for e in down if self.sends_back(e)],
                "adopted": [e.key for e in down if not self.sends_back(e)],
                "private": [e.key for e in self.entries if not self.shares(e)]}
        return self._keys[self.phase][name]

    @property
    def shared_keys(self) -> list[str]:
        """Model entries in this phase's download."""
        return self._rule("shared")

    @property
    def uploaded_keys(self) -> list[str]:
        """Model entries in this phase's upload."""
        return self._rule("uploaded")

    @property
    def private_keys(self) -> list[str]:
        """Model entries not sent down this phase: each client uses its own."""
        return self._rule("private")

    def entry_spec(self, entry: StateEntry, name: str = "") -> TensorSpec:
        """A model entry as it crosses the wire (under ``name``, default its key), marked data-derived
        when it is a statistic of the client's features rather than a trained parameter."""
        derived = self.derived_from_data(entry)
        return TensorSpec(name or entry.key, entry.shape, entry.dtype, derived=derived,
                          exposes="data statistics" if derived else "")

    def downloads_head(self) -> bool:
        """Whether this phase's download holds every classifier entry (what the guiding regularizer needs)."""
        shared = set(self.shared_keys)
        return all(e.key in shared for e in self.entries if e.is_head)

    def policy(self) -> SharePolicy:
        """This phase's tensors per direction and those kept by the client."""
        spec = {e.key: self.entry_spec(e) for e in self.entries}
        return SharePolicy(download=[spec[k] for k in self.shared_keys] + self.extra_download(),
                           upload=[spec[k] for k in self.uploaded_keys] + self.extra_upload(),
                           private=[spec[k] for k in self.private_keys] + self.extra_private(),
                           gathered=tuple(self.gathered_keys()))

    # ------------------------------------------------------------------ server aggregation
    @property
    def num_training_clients(self) -> int:
        """N, the number of training clients."""
        return len(self.training_ids)

    # ------------------------------------------------------------------ evaluation
    @property
    def selection(self) -> str:
        """The run's best-round rule (:meth:`selection_for` its ``--select-by``)."""
        return self.selection_for(self.cfg.select_by)

    @classmethod
    def selection_for(cls, select_by: str) -> str:
        """The best-round rule of a run with ``--select-by`` ``select_by``: itself, or :attr:`selects_by` under
        ``auto`` (a finished run's too, read from its config.json)."""
        return cls.selects_by if select_by == "auto" else select_by

    # ------------------------------------------------------------------ one-time set-up
    @classmethod
    def check_options(cls, cfg: RunConfig) -> None:
        """One line for an option given a value it does not take: a rule option's ``choices``, a count's
        ``minimum`` (:meth:`Option.problem`)."""
        for option in cls.options:  # a configuration built in code may leave an option out: it takes the default
            problem = option.problem(cfg.algo_options.get(option.name, option.default))
            if problem:
                raise MpiflError(problem)

    @classmethod
    def check_task(cls, cfg: RunConfig, task: Task) -> None:
        """A method whose rule needs a class per image refuses a segmentation task in one line (called before
        the model is built)."""
        if task.name != "classification" and cls.classification_only:
            raise MpiflError(f"--algo {cls.name} {cls.classification_only}; {cfg.data} is a {task.name} "
                             "dataset (a class per pixel): pick a method whose rule does not need classes")

    def bind_task(self, task: Task) -> None:
        """The run's task (:mod:`mpifl.plan.task`), from its dataset (:meth:`check_task`)."""
        self.check_task(self.cfg, task)
        self.task = task

    @classmethod
    def norm_kind(cls, cfg: RunConfig) -> str:
        """The run's normalization kind: ``--norm``, or :attr:`norm` under ``auto``; a kind outside
        :attr:`norms` is a one-line error."""
        kind = cls.norm if cfg.norm == "auto" else cfg.norm
        if cls.norms is not None and kind not in cls.norms:
            raise MpiflError(f"--norm {kind}: {cls.name} {cls.norms_because}; use --norm "
                             f"{' or '.join(('auto',) + cls.norms)}, or another --algo")
        return kind

    @classmethod
    def network(cls, cfg: RunConfig, *, num_classes: int, in_channels: int = 3,
                image_size: tuple[int, int] = (28, 28)) -> nn.Module:
        """The network the method trains: ``cfg.model`` with :meth:`norm_kind` and :attr:`conv`, composite
        norms placed by :meth:`norm_placement`, then :meth:`adapt_model`."""
        cls.check_options(cfg)
        model = build_model(cfg.model, num_classes=num_classes, in_channels=in_channels,
                            image_size=tuple(image_size), norm=cls.norm_kind(cfg), conv=cls.conv)
        return cls.adapt_model(place_composite_norms(model, *cls.norm_placement(cfg)), cfg)

    def init_client(self, spec: ClientSpec, initial: dict[str, torch.Tensor]) -> ClientState:
        """Private state starts from the (seeded, rank-independent) initial model."""
        private = {k: initial[k].clone() for k in self.private_keys}
        private.update({s.name: torch.zeros(s.shape, dtype=s.dtype) for s in self.extra_private()})
        return ClientState(spec=spec, private=private)
