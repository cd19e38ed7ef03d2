"""Local training and evaluation of one client's model."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch
from torch import nn

from ..algorithms import Algorithm, ClientState
from ..errors import MpiflError
from ..models import StateEntry
from ..plan.config import RunConfig
from ..plan.optim import keep_state, restore_state
from ..plan.seeding import client_rng, client_torch_seed
from ..plan.task import CLASSIFICATION, Task
from .client_data import ClientData
from .precision import FP32, Precision

if TYPE_CHECKING:
    from ..privacy.dp_sgd import DpSgd


@dataclass
class TrainStats:
    steps: int
    loss_sum: float  # training objective (CE + the method's term) summed over samples
    correct: float  # the task's score summed over samples (classification: correct ones)
    seen: int
    data_seconds: float = 0.0  # spent producing batches (host-side time; on a GPU the indexing is asynchronous)
    epsilon: float = 0.0  # the client's DP-SGD epsilon after this training (0: DP-SGD off)


def train_local(model: nn.Module, algo: Algorithm, client: ClientState, data: ClientData,
                optimizer: torch.optim.Optimizer, epochs: int, batch_size: int,
                rng: np.random.Generator, round_index: int, precision: Precision = FP32,
                trainable: Callable[[StateEntry, int], bool] | None = None, dp: DpSgd | None = None,
                max_steps: int | None = None) -> TrainStats:
    """E epochs of mini-batch SGD on the client's train split; with ``dp``, DP-SGD's (:mod:`mpifl.privacy.dp_sgd`:
    Poisson batches, which may be empty, and the clipped, noised gradient in place of the batch's before the
    method's hooks).

    Loss = the algorithm's batch loss (CE plus the method's terms), with
    the algorithm's gradient corrections between backward and step, then,
    with ``--max-grad-norm c > 0``, the clip of every method (FedNN's
    authors' code): g <- g min(1, c / (||g||_2 + 1e-6)), ||g||_2 over all
    parameters (``torch.nn.utils.clip_grad_norm_``).  Before
    each epoch, the parameters that ``trainable(entry, epoch)`` (default: the
    method's :meth:`Algorithm.trainable`) freezes stop taking gradients.  A
    non-finite loss stops the run: checked once per epoch (one device sync),
    with the loss of the round's first batch, which no local step has moved
    yet, telling the model the client started from apart (:func:`_diverged`).
    """
    algo.train_mode(model)
    trainable = trainable or algo.trainable
    entries = {e.key: e for e in algo.entries}
    parameters = list(model.named_parameters())
    clip = algo.cfg.max_grad_norm
    stats = TrainStats(0, 0.0, 0, 0)
    first_loss = None  # of the round's first batch: the model as the client started it
    for epoch in range(epochs):
        if max_steps is not None and stats.steps >= max_steps:
            break
        for key, parameter in parameters:
            parameter.requires_grad_(trainable(entries[key], epoch))
        loss_sum = torch.zeros((), dtype=torch.float64, device=_device(model))
        correct = torch.zeros((), dtype=torch.float64, device=loss_sum.device)
        seen = 0
        batches = dp.epoch(data, rng) if dp else data.train_batches(rng, batch_size)
        for x, y in _timed(batches, stats):
            if max_steps is not None and stats.steps >= max_steps:
                break
            (dp.optimizer if dp else optimizer).zero_grad(set_to_none=True)
            if len(y):
                with precision.autocast():
                    loss, logits = algo.batch_loss(client, model, precision.inputs(x), y)
                precision.backward(loss, optimizer)
            if dp:
                dp.privatize(empty=not len(y))
            algo.after_backward(client, model)
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            precision.step(optimizer)
            stats.steps += 1
            if not len(y):
                continue
            if first_loss is None:
                first_loss = loss.detach()
            loss_sum += loss.detach().double() * len(y)
            correct += algo.task.score_sum(logits.detach(), y)
            seen += len(y)
        epoch_loss = float(loss_sum)
        if not math.isfinite(epoch_loss):
            raise MpiflError(_diverged(algo, client, round_index, epoch, epoch_loss, float(first_loss)))
        stats.loss_sum += epoch_loss
        stats.correct += float(correct)
        stats.seen += seen
    return stats


def _diverged(algo: Algorithm, client: ClientState, round_index: int, epoch: int, loss: float,
              first_loss: float) -> str:
    """The line for a non-finite loss.  A model that started the round so (its first batch, before any local step)
    came from the initial weights or the last aggregation: the line names what sets those; else local training
    diverged."""
    who = f"client {client.id} ({client.spec.domain})"
    if math.isfinite(first_loss):
        return (f"loss is {loss} for {who} in round {round_index}, epoch {epoch + 1}; lower --lr or check that "
                "client's data")
    if round_index == 1:
        source = "the initial model" + (f" (--pretrained {algo.cfg.pretrained})" if algo.cfg.pretrained else "")
        return (f"loss is {first_loss} for {who} on its first batch of round 1, before any local step: "
                f"{source} gives it; check {'that file' if algo.cfg.pretrained else 'the model and the data'}")
    changed = [f"{o.flag} {algo.cfg.opt(o.name)!r}" for o in algo.options if algo.cfg.opt(o.name) != o.default]
    return (f"loss is {first_loss} for {who} on its first batch of round {round_index}, before any local step: the "
            f"model it started from (round {round_index - 1}'s aggregation by {algo.name}, with any entries the client "
            "keeps) diverged; "
            + (f"check the options this run changed ({', '.join(changed)}), or lower --lr" if changed else
               f"lower --lr (the clients' local steps of round {round_index - 1} went into it) or check "
               f"{algo.name}'s options (--help)"))


@torch.no_grad()
def evaluate(model: nn.Module, data: ClientData, split: str, batch_size: int,
             precision: Precision = FP32, task: Task = CLASSIFICATION) -> tuple[float, float, int]:
    """(summed loss, summed score, count) of the model on one split: for classification the summed
    cross-entropy and the number correct (:mod:`mpifl.plan.task`)."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=_device(model))
    correct = torch.zeros((), dtype=torch.float64, device=loss_sum.device)
    for x, y in data.eval_batches(split, batch_size):
        loss, score = batch_scores(model, x, y, precision, task)
        loss_sum += loss
        correct += score
    return float(loss_sum), float(correct), data.size(split)


@torch.no_grad()
def batch_scores(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: Precision = FP32,
                 task: Task = CLASSIFICATION) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (summed loss, summed score) of one batch under the model as it is (in evaluation mode)."""
    with precision.autocast():
        logits = model(precision.inputs(x)).float()
    return task.loss_sum(logits, y).double(), task.score_sum(logits, y).double()


def load_state(slots: dict[str, torch.Tensor], algo: Algorithm, download: dict[str, torch.Tensor],
               private: dict[str, torch.Tensor]) -> None:
    """A client's model state: the shared entries from the download, the others from ``private``
    (``slots``: the model's state dict, whose tensors alias the model's)."""
    keys = algo.shared_keys + algo.private_keys
    copy_all([slots[k] for k in keys], [download[k] for k in algo.shared_keys] + [private[k] for k in algo.private_keys])


def client_round(model: nn.Module, slots: dict[str, torch.Tensor], algo: Algorithm, client: ClientState,
                 data: ClientData, download: dict[str, torch.Tensor], round_index: int, cfg: RunConfig,
                 precision: Precision = FP32,
                 max_steps: int | None = None) -> tuple[dict[str, torch.Tensor], TrainStats]:
    """One client's round on a model holding its starting state (:func:`load_state`): the method's hooks
    (:meth:`~mpifl.algorithms.core.base.Algorithm.score_local` before and after training) and local training,
    seeded by (seed, client, round); then the client keeps its private entries and the round's upload is
    returned (the method's model entries and extra tensors; views of ``slots``).  The
    optimizer is the method's at the round's learning rate; with ``--keep-optimizer`` it starts from the
    client's kept state and leaves its own there (:mod:`mpifl.plan.optim`); with ``--dpsgd-clip`` it steps on
    DP-SGD's gradients and the client's epsilon comes back in the stats (:mod:`mpifl.privacy.dp_sgd`).  The
    guiding regularizer's global head (``--guide-lambda``) is held from ``begin_local`` to the end of the round's
    training."""
    torch.manual_seed(client_torch_seed(cfg.seed, client.id, round_index))

    def score(split: str) -> tuple[float, float, int]:
        return evaluate(model, data, split, cfg.eval_batch_size, precision, algo.task)

    algo.score_local(client, model, "downloaded", score)
    algo.begin_local(client, model, download)
    optimizer = algo.make_optimizer(model, algo.lr)
    if cfg.keep_optimizer:
        restore_state(optimizer, model, client.private)
    dp = None
    if cfg.dpsgd_clip:
        from ..privacy.dp_sgd import DpSgd  # Opacus, the privacy extra: imported where DP-SGD is on
        dp = DpSgd(model, optimizer, algo, client, round_index)
    stats = train_local(model, algo, client, data, optimizer, algo.local_epochs(), cfg.batch_size,
                        client_rng(cfg.seed, client.id, round_index), round_index, precision, dp=dp,
                        max_steps=max_steps)
    if dp:
        stats.epsilon = dp.finish()
    algo.release_global_head()
    if cfg.keep_optimizer:
        keep_state(optimizer, model, client.private)
    copy_all([client.private[k] for k in algo.private_keys], [slots[k] for k in algo.private_keys])
    algo.score_local(client, model, "trained", score)
    upload = {k: slots[k] for k in algo.uploaded_keys}
    upload.update(algo.end_local(client, model))
    return upload, stats


@torch.no_grad()
def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """In-place copies in one fused call (torch's foreach kernels refuse empty lists)."""
    if targets:
        torch._foreach_copy_(targets, sources)


def _timed(batches: Iterator, stats: TrainStats) -> Iterator:
    """``batches``, adding the time each takes to arrive to ``stats.data_seconds``."""
    batches = iter(batches)
    while True:
        start = time.perf_counter()
        batch = next(batches, None)
        stats.data_seconds += time.perf_counter() - start
        if batch is None:
            return
        yield batch


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
