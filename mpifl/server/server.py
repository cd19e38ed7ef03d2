"""Rank 0: global state, client sampling, aggregation, checkpoints and the run log.

Round r (docs/design.md, "One round"): sample the clients, broadcast the header and the download, fold the
clients' uploads into the algorithm's sums as they arrive, while the clients train
(:mod:`mpifl.algorithms.core.reduction`), gather the clients' records and small uploads, aggregate.  A method
whose sums' coefficients need what training returned (:attr:`~mpifl.algorithms.Algorithm.reductions_need_results`)
folds after the gather instead.  Evaluation rides on the next message: the download of round r+1 is the global
model after round r, so its header asks the clients to evaluate it first, and their scores come back in the
same gather as the round's records.  A final message after the last round only evaluates, then every rank
stops.  Which message carries what is the round protocol's (:mod:`mpifl.session.protocol`).

Checkpoints (:mod:`mpifl.rundir.checkpoint`) ride on messages too: the message of round r+1 carries the
SAVE flag when round r is to be checkpointed (``--ckpt-every``, the last round, or a stop signal), and a
STOP message replaces round r+1 when a stop signal arrived during round r, here or on a client rank (which
reports it in its upload).
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import numpy as np

from ..algorithms import Reduction, Uploads
from ..data.manifest import build_of
from ..process.faults import maybe_inject
from ..process.signals import StopRequest
from ..rundir.checkpoint import Checkpoint, FileRecord, identity, load_server, rank_file
from ..rundir.names import SERVER_FILE
from ..rundir.rundir import RunDir
from ..session.protocol import RoundPlan, RoundProtocol
from ..session.session import Session
from ..transport.buffers import ReusedBuffer
from ..transport.comm import Comm
from ..transport.exchange import exchange_all
from ..transport.messages import (CLIENT_META, FINAL, NO_EVAL, RANK_SECONDS, STOP, Messages, peak_rss, records,
                                  saved_file)
from .folding import Behind, Folding, FoldThreads
from .run_log import MetricsLog, summarize_eval
from .run_log import dp_sgd_epsilons, local_val_acc


# each client rank's seconds of a round in metrics.jsonl (rank_seconds), by the fields of its report
RANK_FIELDS = (("compute", "train"), ("evaluation", "evaluate"), ("data", "data"), ("communication", "communication"),
               ("waiting", "waiting"))
# rank 0 receives this many bytes of clients' uploads (at least one client's) at once, into one of two buffers
# while the other's are folded
FOLD_WINDOW_BYTES = 256 << 20


class Server:
    """The server's part of a run: owns the global state (the algorithm's :class:`ServerState`), samples
    each round's clients, broadcasts the download, gathers the uploads and evaluation scores, aggregates
    with the algorithm's rule, writes ``metrics.jsonl`` and the server's checkpoint files.

    ``run()`` drives the whole run after set-up; ``stopped_by`` then names the signal that ended it early.
    """

    def __init__(self, session: Session, comm: Comm, log: MetricsLog,
                 on_round: Callable[[int, int | None, float | None], None], run_dir: RunDir,
                 resumed: Checkpoint | None = None, stop: StopRequest | None = None, threads: list[int] | None = None,
                 folds: FoldThreads | None = None, tracked: dict[str, str] | None = None):
        self.session, self.comm, self.log, self.on_round = session, comm, log, on_round
        self.run_dir, self.resumed, self.stop = run_dir, resumed, stop or StopRequest()
        self.threads = threads  # each client rank's torch threads, for the checkpoints
        self.tracked = tracked  # each live tracker's run (--track), for the checkpoints
        self.algo, self.privacy = session.algo, session.privacy
        self.protocol = RoundProtocol(session, start=resumed.round if resumed else 0)
        self.state = load_server(run_dir.path, resumed) if resumed else self._new_state()
        self.stopped_by: str | None = None  # the signal that stopped the run early, if one did ('SIGTERM on rank 2')
        self.stopped_after = 0  # and the last round it completed
        self.down_buffer = ReusedBuffer()
        self.folds = folds or FoldThreads()  # the threads that fold the uploads (--fold-threads)
        self.fold_buffer = ReusedBuffer()  # the clients' summed uploads received, not folded yet
        self.receiving_seconds = 0.0  # of the round, in _fold's receives: communication or waiting, not aggregation

    def run(self) -> None:
        exchange_all(self.comm, self.session.exchanges, self.session.trainers_by_rank, lambda exchange: [])
        for r in self.protocol.rounds():
            stop_requested = self.stop.requested
            started = time.perf_counter()
            maybe_inject(rank=0, client=-1, round_index=r)
            messages = self.protocol.open(r)
            header = self.protocol.header(r, stop_requested)
            if header.saves:  # the state after round r-1, and its record still waiting for an evaluation
                server_file = self.run_dir.save_server(r - 1, self.state)
                pending = copy.deepcopy(self.log.pending)
            down = self.down_buffer.get(messages.down.nbytes)
            waiting, moving = self.comm.seconds_waiting, self.comm.seconds_moving
            polling = self.comm.cpu_seconds_waiting
            messages.pack_down(header, self.algo.download(self.state) | self.privacy.download(self.state), out=down)
            self.comm.bcast(down)
            plan = self.protocol.plan(header, messages)
            self.receiving_seconds = 0.0
            early = bool(plan.uploads) and not self.algo.reductions_need_results
            fold_started = time.perf_counter()
            if early:  # while the clients train
                sums = self._fold(messages, plan, self.session.reductions(self.state, self.session.planned(r)))
            early_folding = time.perf_counter() - fold_started
            segments = self.comm.gatherv(np.empty(0, dtype=np.uint8), list(plan.upload_bytes))
            reports, evals, uploads = self._decode(messages, plan, segments)
            for rank, report in enumerate(reports, start=1):
                if report["rank.stop"]:
                    self.stop.heard_on(rank, int(report["rank.stop"]))
            if header.saves:  # the gather proves every client rank has written its file, and says what it wrote
                files = {SERVER_FILE: server_file} | {rank_file(rank): FileRecord(*saved_file(report))
                                                      for rank, report in enumerate(reports, start=1)}
                self.run_dir.commit(Checkpoint(round=r - 1, clients=len(self.session.clients), pending=pending,
                                               ranks={h + 1: ids for h, ids in enumerate(self.session.placement)},
                                               identity=identity(self.session.cfg), files=files,
                                               data=build_of(self.session.manifest), threads=self.threads,
                                               tracking=self.tracked))
            if header.action == STOP:
                self.stopped_by, self.stopped_after = self.stop.describe(), r - 1
                break
            if header.evaluate != NO_EVAL:
                self.log.add_eval(header.evaluate, summarize_eval(evals, self.algo.evaluates, self.session.domain_of,
                                                                  self.session.manifest.domains,
                                                                  self.session.source_domains, self.algo.task.metric))
                self._report_progress(header.evaluate)
            if header.action == FINAL:
                break
            aggregated_from = time.perf_counter()
            if len(uploads.clients) or self.privacy.steps_without_clients:  # else the global state stays as it was
                self.algo.prepare(self.state, uploads)
                if not early:
                    sums = self._fold(messages, plan, self.session.reductions(self.state, uploads))
                uploads.sums = sums
                self.privacy.release(self.state, sums, uploads.clients, r)
                self.algo.aggregate(self.state, uploads)
            spent = self.privacy.record(self.state)  # the accountant's step is the aggregation's too
            finished = time.perf_counter()
            seconds = records([report["rank.seconds"] for report in reports], RANK_SECONDS)
            self.log.add_round(self._record(r, messages, uploads, seconds, reports, plan, down.nbytes, spent, {
                "round": finished - started, "communication": self.comm.seconds_moving - moving,
                "waiting": self.comm.seconds_waiting - waiting, "waiting_cpu": self.comm.cpu_seconds_waiting - polling,
                "aggregation": early_folding + finished - aggregated_from - self.receiving_seconds}),
                awaits_eval=self.protocol.evaluates_round(r))
            if not self.protocol.evaluates_round(r):  # an evaluated round is reported when its evaluation arrives
                self._report_progress(r)

    def _new_state(self):
        state = self.algo.init_server(self.session.initial)
        self.privacy.init_server(state)
        return state

    def _report_progress(self, r: int) -> None:
        """Round r is complete: the progress line and log.txt, with the newest mean test accuracy known."""
        self.on_round(r, *self.log.last_mean_acc())

    def _decode(self, messages: Messages, plan: RoundPlan, segments):
        """Each client rank's report, {client: eval scores} (the evaluation plan's sums of the ranks' parts), and
        the round's uploads in client-id order."""
        reports, scores, personal, by_client = [], [], {}, {}
        for rank, work in enumerate(plan.work, start=1):
            report, scored, eval_segs, client_segs = messages.segments(
                segments[rank], len(work.uploads), len(work.evaluates), len(work.scores))
            reports.append(messages.rank.unpack(report))
            scores.append(messages.scores(len(work.scores)).unpack(scored)["eval.scores"])
            personal.update((c, messages.eval.unpack(s)["client.eval"]) for c, s in zip(work.evaluates, eval_segs))
            by_client.update((c, messages.client.unpack(s)) for c, s in zip(work.uploads, client_segs))
        evals = self.session.evaluation().add_up(scores, personal) if plan.header.evaluate != NO_EVAL else {}
        views = [by_client[c] for c in plan.uploads]
        uploads = Uploads(clients=np.array(plan.uploads, dtype=np.int64),
                          meta=records([v["client.meta"] for v in views], CLIENT_META),
                          tensors={n: [v[n] for v in views] for n in messages.gathered_names},
                          staleness=np.array(plan.fate.staleness, dtype=np.int64) if plan.fate.staleness else None)
        return reports, evals, uploads

    def _fold(self, messages: Messages, plan: RoundPlan, reductions: dict[str, Reduction]) -> dict[str, np.ndarray]:
        """Receive every trained client's summed uploads in client-id order, ``FOLD_WINDOW_BYTES`` at a time (at
        least one client), and add them into the sums of ``reductions`` behind the receives
        (:class:`~.folding.Behind`): the fold threads add a window's clients while the next
        window arrives into the other buffer, so once the last upload has arrived only the last window's fold is
        left.  Under ``--secure-aggregation`` the uploads are masked integers, summed modulo 2^w and turned into
        the float64 sums at the end (:mod:`mpifl.privacy.secure`).

        Time: the receives count in ``receiving_seconds`` (communication or waiting), whatever is folded meanwhile;
        what the round spends on the fold alone, waiting for a buffer to be folded before the next receive into
        it and for the last folds after the last receive, is left to aggregation."""
        secure = self.session.secure and self.session.secure.open(plan.header.round, reductions, messages)
        folding = Folding(secure.folded if secure else reductions, self.folds)
        size = messages.summed.nbytes
        if size:
            owner = {c: rank for rank, work in enumerate(plan.work, start=1) for c in work.uploads}
            window = max(1, min(len(plan.uploads), FOLD_WINDOW_BYTES // size))
            buffers = min(len(plan.uploads), 2 * window if self.folds.behind else window)
            buf = self.fold_buffer.get(buffers * size)
            behind = Behind(folding)
            for start in range(0, len(plan.uploads), window):
                clients = plan.uploads[start:start + window]
                behind.wait(start + len(clients) - buffers)  # the uploads these buffers held are folded
                parts = [buf[k % buffers * size:(k % buffers + 1) * size] for k in range(start, start + len(clients))]
                started = time.perf_counter()
                self.comm.receive(parts, [owner[c] for c in clients], "the clients' uploads")
                self.receiving_seconds += time.perf_counter() - started
                behind.hand([messages.summed.unpack(part) for part in parts])
            behind.wait(len(plan.uploads))
        return secure.sums(folding.sums) if secure else folding.sums

    def _record(self, r: int, messages: Messages, uploads: Uploads, seconds: np.ndarray, reports: list[dict],
                plan: RoundPlan, down_bytes: int, spent: dict | None, server_seconds: dict) -> dict:
        k, meta = len(uploads.clients), uploads.meta
        seen = meta["seen"].sum()
        by_rank = {name: seconds[field].tolist() for name, field in RANK_FIELDS}
        slowest = {name: max(by_rank[name], default=0.0) for name in ("compute", "evaluation", "data")}
        train = {"loss": float(meta["loss_sum"].sum() / seen),
                 self.algo.task.metric: float(meta["correct"].sum() / seen)} if seen else {}  # none took part
        if self.algo.selection == "local-val":
            train["local_val_acc"] = local_val_acc(meta)
        dp_sgd = {"dp_sgd": dp_sgd_epsilons(meta)} if self.session.cfg.dpsgd_clip else {}
        return {
            "round": r,
            "clients": uploads.clients.tolist(),
            "train": train,
            "bytes": {"down": messages.policy_down_bytes * len(plan.fate.trains), "up": messages.policy_up_bytes * k,
                      "wire_down": down_bytes * (self.comm.size - 1),
                      "wire_up": int(sum(plan.upload_bytes)) + k * messages.summed.nbytes},
            "seconds": {**server_seconds, **slowest},
            "rank_seconds": by_rank,
            "memory": {"peak_rss": [peak_rss()] + [int(report["rank.peak_rss"]) for report in reports],
                       "peak_gpu": [0] + [int(report["rank.peak_gpu"]) for report in reports]},
        } | dp_sgd | ({"privacy": spent} if spent else {}) | ({"sim": plan.fate.record()} if self.session.clock else {})
