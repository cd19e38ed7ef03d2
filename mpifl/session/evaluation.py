"""The global model's evaluation, spread over the client ranks by batches (docs/design.md, "Evaluation").

What: every client's val and test split under the global model, in the batches its data forms
(:func:`~mpifl.plan.batches.eval_bounds`).  A rank scores its batches and sends each one's float64 (loss sum,
score sum); rank 0 adds those of a client's split in batch order, from 0 (:meth:`EvalPlan.add_up`): the very
chain of float64 additions one pass over the split makes on one rank.  A batch holds the same rows, and scores
to the same bits, on any rank (a model in evaluation mode, the same torch threads), so the numbers are bit for
bit those of one rank evaluating everything, for any number of ranks.

Who scores what follows from the configuration alone, the same on every rank:

* a *group*, placed whole, is one batch, or a client's whole evaluation where the method draws random numbers
  through it (:attr:`~mpifl.algorithms.Algorithm.global_eval_per_batch` false: FedNN's Gumbel draws);
* a group is *bound* to its client's host when only that rank can score it: a training client's where its
  global model holds its own trained entries (:attr:`~mpifl.algorithms.Algorithm.global_model_shared` false),
  and every client's under ``--aug`` other than none (a client's input statistics are its own, computed on
  its host); any other group may go to any rank, which scores it with the client's initial state (and the
  adopted entries): the same global model (a held-out domain never trains, so its host uses that state too);
* a rank's load is the images it evaluates: first its personal evaluations (a personal model needs its
  client's private state, on the host) and its bound groups; then the free groups, largest first, each to its
  client's host if that keeps the host within the mean load (its images are there already), else to the
  least-loaded rank (the lowest on ties).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from ..algorithms import Algorithm
from ..plan.batches import eval_bounds, split_segments, streams
from ..plan.clients import ClientSpec
from ..plan.config import RunConfig
from ..transport.messages import EVAL_SPLITS

GLOBAL = "global"  # the evaluated model kind this module spreads; any other is a client's personal model


@dataclass(frozen=True)
class EvalBatch:
    """One batch of the global model's evaluation: positions ``start`` .. ``stop - 1`` of a client's split."""

    client: int
    split: int  # index into EVAL_SPLITS
    start: int
    stop: int


@dataclass(frozen=True)
class EvalPlan:
    """Every batch of the global model's evaluation and the rank scoring it, and who evaluates personal models."""

    kinds: tuple[str, ...]  # the models the method evaluates (Algorithm.evaluates)
    num_clients: int
    batches: tuple[EvalBatch, ...]  # by client, split and position
    rank_of: tuple[int, ...]  # the client rank (from 1) scoring each batch
    personal: tuple[tuple[int, ...], ...]  # per client rank: the hosted clients whose personal models it evaluates
    images: tuple[int, ...]  # per client rank: the images it evaluates

    @property
    def personal_kinds(self) -> int:
        return len(self.kinds) - (GLOBAL in self.kinds)

    @cached_property
    def _scored(self) -> dict[int, list[int]]:
        """Each client rank's batches, by index, in plan order."""
        out: dict[int, list[int]] = {}
        for i, rank in enumerate(self.rank_of):
            out.setdefault(rank, []).append(i)
        return out

    def scored_by(self, rank: int) -> tuple[EvalBatch, ...]:
        """The batches client rank ``rank`` scores, in plan order."""
        return tuple(self.batches[i] for i in self._scored.get(rank, ()))

    def add_up(self, scores: Sequence[np.ndarray], personal: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Every client's (kind, split, [loss sum, score sum, count]) array from each client rank's (loss sum, score
        sum) of its batches (``scores[k]``: rank k+1's, in :meth:`scored_by` order) and the personal models' arrays
        (kind, split, 3) by client; a split's sums are added in batch order, from 0."""
        values = np.zeros((len(self.batches), 2))
        for rank, mine in enumerate(scores, start=1):
            values[self._scored.get(rank, [])] = mine
        out = {c: np.zeros((len(self.kinds), len(EVAL_SPLITS), 3)) for c in range(self.num_clients)}
        rows = [k for k, kind in enumerate(self.kinds) if kind != GLOBAL]
        for c, block in personal.items():
            out[c][rows] = block
        if GLOBAL in self.kinds:
            g = self.kinds.index(GLOBAL)
            for batch, (loss, score) in zip(self.batches, values.tolist()):
                total = out[batch.client][g, batch.split]
                total += (loss, score, batch.stop - batch.start)
        return out


def plan_evaluation(clients: list[ClientSpec], placement: list[list[int]], algo: Algorithm, cfg: RunConfig,
                    image_bytes: int) -> EvalPlan:
    """The evaluation plan of a run's current stage (see the module docstring)."""
    hosts = len(placement)
    host = {c: h for h, hosted in enumerate(placement) for c in hosted}
    personal_kinds = len(algo.evaluates) - (GLOBAL in algo.evaluates)
    personal = tuple(tuple(c for c in hosted if clients[c].trains) if personal_kinds else () for hosted in placement)
    load = [personal_kinds * sum(len(clients[c].rows[s]) for c in mine for s in EVAL_SPLITS) for mine in personal]
    groups = _groups(clients, algo, cfg, image_bytes) if GLOBAL in algo.evaluates else []
    owner: list[int | None] = [None] * len(groups)
    for i, (client, batches, bound) in enumerate(groups):
        if bound:
            owner[i] = host[client]
            load[owner[i]] += _images(batches)
    mean = (sum(load) + sum(_images(batches) for _, batches, bound in groups if not bound)) / hosts
    free = sorted((i for i in range(len(groups)) if owner[i] is None), key=lambda i: (-_images(groups[i][1]), i))
    for i in free:  # largest first: the last, smallest ones even the loads out
        client, batches, _ = groups[i]
        fits = load[host[client]] + _images(batches) <= mean
        owner[i] = host[client] if fits else min(range(hosts), key=lambda h: (load[h], h))
        load[owner[i]] += _images(batches)
    return EvalPlan(kinds=tuple(algo.evaluates), num_clients=len(clients),
                    batches=tuple(b for _, batches, _ in groups for b in batches),
                    rank_of=tuple(owner[i] + 1 for i, (_, batches, _) in enumerate(groups) for _ in batches),
                    personal=personal, images=tuple(load))


def _groups(clients: list[ClientSpec], algo: Algorithm, cfg: RunConfig,
            image_bytes: int) -> list[tuple[int, list[EvalBatch], bool]]:
    """(client, its batches placed together, bound to its host) in client, split and position order."""
    out = []
    for client in clients:
        segments = split_segments(client)
        streamed = streams(client, image_bytes, cfg.stream_above)
        batches = [EvalBatch(client.id, s, start, stop) for s, split in enumerate(EVAL_SPLITS)
                   for start, stop in eval_bounds(segments[split], cfg.eval_batch_size, streamed)]
        tied = bound(client, algo, cfg)
        out += [(client.id, [b], tied) for b in batches] if algo.global_eval_per_batch else [(client.id, batches, tied)]
    return out


def bound(client: ClientSpec, algo: Algorithm, cfg: RunConfig) -> bool:
    """Whether only the client's host can score its batches of the global model's evaluation."""
    return cfg.aug != "none" or (client.trains and not algo.global_model_shared)


def _images(batches: list[EvalBatch]) -> int:
    return sum(b.stop - b.start for b in batches)
