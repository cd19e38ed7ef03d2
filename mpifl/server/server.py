"""Rank 0: global state, client sampling, aggregation, metrics (DESIGN 1-2).

Round r: sample the clients, broadcast the header and the download, gather
the uploads, aggregate.  Evaluation rides on the next message: the download
of round r+1 is the global model after round r, so its header asks the
clients to evaluate it first, and their scores come back in the same gather
as the round's uploads.  A final message after the last round only
evaluates, then every rank stops.

Checkpoints (``mpifl.job.checkpoint``) ride on messages too: the message of
round r+1 carries the SAVE flag when round r is to be checkpointed
(``--ckpt-every``, the last round, or a stop signal), and a STOP message
replaces round r+1 when a stop signal arrived during round r.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..algorithms import Uploads
from ..client.normalize import EXCHANGED, exchange_stats
from ..transport.buffers import ReusedBuffer
from ..job.checkpoint import Checkpoint, commit, identity, load_server, save_server
from ..transport.mpi import Comm
from ..transport.exchange import exchange_once
from ..job.faults import maybe_inject
from ..transport.messages import (
    CLIENT_META_FIELDS,
    FINAL,
    NO_EVAL,
    RANK_SECONDS_FIELDS,
    SAVE,
    STOP,
    TRAIN,
    Header,
    Messages,
)
from .run_log import MetricsLog, summarize_eval
from ..plan.session import Session
from ..job.signals import StopRequest


class Server:
    def __init__(self, session: Session, comm: Comm, log: MetricsLog,
                 on_round: Callable[[int, float | None], None], run_dir: Path,
                 resumed: Checkpoint | None = None, stop: StopRequest | None = None):
        self.session, self.comm, self.log, self.on_round = session, comm, log, on_round
        self.run_dir, self.resumed, self.stop = run_dir, resumed, stop or StopRequest()
        self.algo = session.algo
        self.state = load_server(run_dir, resumed) if resumed else self.algo.init_server(session.initial)
        self.hosted = [set(h) for h in session.placement]  # one set per client rank
        self.stopped_by: str | None = None  # the signal that stopped the run early, if one did
        self.stopped_after = 0  # and the last round it completed
        self.down_buffer = ReusedBuffer()

    @staticmethod
    def evaluates_round(cfg, r: int) -> bool:
        """Whether round r's model is evaluated (in round r+1's message)."""
        return r % cfg.eval_every == 0 or r == cfg.rounds

    def _is_eval_round(self, r: int) -> bool:
        return self.evaluates_round(self.session.cfg, r)

    def _saves_before(self, r: int, start: int) -> bool:
        """Whether round r's message checkpoints round r-1 (not the round just resumed from)."""
        every, done = self.session.cfg.ckpt_every, r - 1
        return every > 0 and done > start and (done % every == 0 or done == self.session.cfg.rounds)

    def run(self) -> None:
        if self.session.cfg.aug in EXCHANGED:  # FedRDN: the clients' statistics, once
            exchange_stats(self.comm, [], self.session.trainers_by_rank, self.session.manifest.channels)
        spec = self.algo.setup_exchange()
        if spec is not None:  # the method's one-time exchange: rank 0 orders the rows and broadcasts them
            self.algo.setup_received(exchange_once(self.comm, [], self.session.trainers_by_rank, spec, spec.name))
        rounds = self.session.cfg.rounds
        start = self.resumed.round if self.resumed else 0
        evaluate = start if start and self._is_eval_round(start) else NO_EVAL
        for r in range(start + 1, rounds + 2):
            stop = r <= rounds and self.stop.signal_name is not None
            final = r == rounds + 1 or stop
            saves = stop or self._saves_before(r, start)
            started = time.perf_counter()
            maybe_inject(rank=0, client=-1, round_index=r)
            if r <= rounds:  # as the client ranks do, before they know the command: same layouts
                self.algo.enter_round(r)
            if stop:
                evaluate = NO_EVAL  # round r-1's evaluation waits for the resumed run, in its pending record
            if saves:
                save_server(self.run_dir, r - 1, self.state)
                pending = copy.deepcopy(self.log.pending)
            messages = self.session.messages()
            down = self.down_buffer.get(messages.down.nbytes)
            waiting, moving = self.comm.seconds_waiting, self.comm.seconds_moving
            polling = self.comm.cpu_seconds_waiting
            command = (STOP if stop else FINAL if final else TRAIN) | (SAVE if saves else 0)
            messages.pack_down(Header(command, r, evaluate), self.algo.download(self.state), out=down)
            self.comm.bcast(down)
            sampled = [] if final else [int(c) for c in self.session.sampled(r)]
            counts = [0] + [messages.upload_bytes(len(h.intersection(sampled)), len(h) if evaluate != NO_EVAL else 0)
                            for h in self.hosted]
            segments = self.comm.gatherv(np.empty(0, dtype=np.uint8), counts)
            seconds, evals, uploads = self._decode(messages, segments, sampled, evaluate != NO_EVAL)
            if saves:  # the gather proves every client rank has written its file
                commit(self.run_dir, Checkpoint(round=r - 1, clients=len(self.session.clients), pending=pending,
                                                ranks={h + 1: ids for h, ids in enumerate(self.session.placement)},
                                                identity=identity(self.session.cfg)))
            if stop:
                self.stopped_by, self.stopped_after = self.stop.signal_name, r - 1
                break
            if evaluate != NO_EVAL:
                self.log.add_eval(evaluate, summarize_eval(evals, self.algo.evaluates, self.session.domain_of,
                                                           self.session.manifest.domains,
                                                           self.session.source_domains))
            if final:
                self._report_progress()
                break
            aggregated_from = time.perf_counter()
            self.algo.aggregate(self.state, uploads)
            finished = time.perf_counter()
            evaluate = r if self._is_eval_round(r) else NO_EVAL
            self.log.add_round(self._record(r, messages, uploads, seconds, counts, down.nbytes, {
                "round": finished - started, "communication": self.comm.seconds_moving - moving,
                "waiting": self.comm.seconds_waiting - waiting, "waiting_cpu": self.comm.cpu_seconds_waiting - polling,
                "aggregation": finished - aggregated_from}),
                awaits_eval=evaluate != NO_EVAL)
            self._report_progress()

    def _report_progress(self) -> None:
        """Rounds whose record is complete (an evaluated round completes one message later)."""
        if self.log.records:
            self.on_round(self.log.records[-1]["round"], self.log.last_mean_acc())

    def _decode(self, messages: Messages, segments, sampled: list[int], evaluating: bool):
        """Rank timings, {client: eval scores}, and the round's uploads in client-id order."""
        seconds, evals, by_client = [], {}, {}
        for rank, hosted in enumerate(self.hosted, start=1):
            trained = sorted(hosted.intersection(sampled))
            evaluated = sorted(hosted) if evaluating else []
            sec, eval_segs, client_segs = messages.segments(segments[rank], len(trained), len(evaluated))
            seconds.append(messages.seconds.unpack(sec)["rank.seconds"])
            evals.update((c, messages.eval.unpack(s)["client.eval"]) for c, s in zip(evaluated, eval_segs))
            by_client.update((c, messages.client.unpack(s)) for c, s in zip(trained, client_segs))
        views = [by_client[c] for c in sampled]
        uploads = Uploads(clients=np.array(sampled, dtype=np.int64),
                          meta=np.array([v["client.meta"] for v in views]).reshape(len(views), len(CLIENT_META_FIELDS)),
                          tensors={n: [v[n] for v in views] for n in messages.upload_names})
        return np.array(seconds).reshape(-1, len(RANK_SECONDS_FIELDS)), evals, uploads

    def _record(self, r: int, messages: Messages, uploads: Uploads, seconds: np.ndarray, counts: list[int],
                down_bytes: int, server_seconds: dict) -> dict:
        k, meta = len(uploads.clients), uploads.meta
        seen = meta[:, 4].sum()
        return {
            "round": r,
            "clients": uploads.clients.tolist(),
            "train": {"loss": float(meta[:, 2].sum() / seen), "acc": float(meta[:, 3].sum() / seen)},
            "bytes": {"down": messages.policy_down_bytes * k, "up": messages.policy_up_bytes * k,
                      "wire_down": down_bytes * (self.comm.size - 1), "wire_up": int(sum(counts))},
            "seconds": {**server_seconds,
                        "compute": float(seconds[:, 0].max()) if len(seconds) else 0.0,
                        "evaluation": float(seconds[:, 1].max()) if len(seconds) else 0.0,
                        "data": float(seconds[:, 2].max()) if len(seconds) else 0.0},
        }
