"""The round protocol: which message a run sends when, and what every rank does with it.

A run from round ``start`` (0, or the round a checkpoint holds) to ``R`` sends one message per round
``r = start+1 .. R``, then a final one (``r = R+1``); docs/design.md ("One round") draws one round.  Each
message is a broadcast from rank 0 (header + the algorithm's download) answered by one gather (every
client rank's timings, evaluations and uploads).  Its header says:

* **command** ``TRAIN`` (round r), ``FINAL`` (only evaluate, after the last round) or ``STOP`` (a stop
  signal arrived during round r-1: save and end), with the ``SAVE`` flag when round r-1 is checkpointed
  first (``--ckpt-every``, the last round, a stop);
* **evaluate**: round r-1's global model is in this download, so the clients evaluate it before
  training (on evaluation rounds, ``--eval-every``); a stop leaves it to the resumed run.

:class:`RoundProtocol` owns these rules and the layouts of each round, and :class:`RoundPlan` says for
every rank which clients it trains and evaluates and how many bytes it sends, from the header alone; the
server and the client hosts both call it, so nothing about a round is computed twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan.clock import Fate, plain_fate
from ..transport.messages import FINAL, NO_EVAL, SAVE, STOP, TRAIN, Header, Messages
from .evaluation import EvalBatch
from .session import Session


@dataclass(frozen=True)
class RankWork:
    """One client rank's part of a round: the clients it trains, those whose uploads it sends (trained now or, under
    asynchronous aggregation, held since an earlier message), those whose personal models it evaluates, ascending
    ids, and the batches of the global model's evaluation it scores (:mod:`mpifl.session.evaluation`).  A client
    that trains but does not upload now either holds its upload for a later step (``holds``) or lost it."""

    trains: tuple[int, ...]
    evaluates: tuple[int, ...]
    scores: tuple[EvalBatch, ...] = ()
    uploads: tuple[int, ...] = ()
    holds: tuple[int, ...] = ()


@dataclass(frozen=True)
class RoundPlan:
    """What one message asks of every rank."""

    header: Header
    uploads: tuple[int, ...]  # the clients whose uploads this message carries, ascending (none for FINAL and STOP)
    work: tuple[RankWork, ...]  # client rank k+1's part
    upload_bytes: tuple[int, ...]  # bytes each rank sends in the gather (0 for the server)
    fate: Fate  # the message's clients under the simulated conditions (mpifl.plan.clock)

    def of(self, rank: int) -> RankWork:
        """Client rank ``rank``'s part (ranks from 1)."""
        return self.work[rank - 1]


class RoundProtocol:
    """The round rules of one run, the same on every rank."""

    def __init__(self, session: Session, start: int = 0):
        self.session = session
        self.cfg = session.cfg
        self.start = start  # the round the run continues from

    def rounds(self) -> range:
        """The index of every message: rounds start+1..R, then R+1, the final evaluation."""
        return range(self.start + 1, self.cfg.rounds + 2)

    def open(self, r: int) -> Messages:
        """Enter round r on this rank (the algorithm's stage and schedules) and give its message layouts.

        Called before the message travels, on every rank alike: a client host does not yet know whether
        the message stops the run, so the final and stop messages use round r's layouts too."""
        if r <= self.cfg.rounds:
            self.session.algo.enter_round(r)
        return self.session.messages()

    def evaluates_round(self, r: int) -> bool:
        """Whether round r's model is evaluated (in round r+1's message)."""
        return r % self.cfg.eval_every == 0 or r == self.cfg.rounds

    def header(self, r: int, stop_requested: bool) -> Header:
        """Rank 0's header of message r; ``stop_requested``: a stop signal arrived before it."""
        final = r == self.cfg.rounds + 1
        stop = stop_requested and not final
        done = r - 1  # the round whose model this message carries
        every = self.cfg.ckpt_every
        saves = stop or (every > 0 and done > self.start and (done % every == 0 or done == self.cfg.rounds))
        evaluate = done if done >= 1 and self.evaluates_round(done) and not stop else NO_EVAL
        command = STOP if stop else FINAL if final else TRAIN
        return Header(command | (SAVE if saves else 0), r, evaluate)

    def plan(self, header: Header, messages: Messages) -> RoundPlan:
        """Every rank's part of the message with ``header`` (identical on every rank)."""
        fate = self.session.fate(header.round) if header.action == TRAIN else plain_fate(np.empty(0, dtype=np.int64))
        uploads, holds = set(fate.uploads), set(fate.holds)
        evaluating = header.evaluate != NO_EVAL
        evaluation = self.session.evaluation()
        work = tuple(RankWork(trains=tuple(c for c in hosted if c in fate.trains),
                              evaluates=evaluation.personal[h] if evaluating else (),
                              scores=evaluation.scored_by(h + 1) if evaluating else (),
                              uploads=tuple(c for c in hosted if c in uploads),
                              holds=tuple(c for c in hosted if c in holds))
                     for h, hosted in enumerate(self.session.placement))
        upload = (0,) + tuple(messages.upload_bytes(len(w.uploads), len(w.evaluates), len(w.scores)) for w in work)
        return RoundPlan(header=header, uploads=fate.uploads, work=work, upload_bytes=upload, fate=fate)
