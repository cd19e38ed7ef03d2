"""What every rank does with a parsed command: set up together, run its role, end.

Over MPI (``mpirun -n R``, ``srun``) each rank is a process; started without a launcher, the server and
one client host are two threads of this process (:mod:`mpifl.transport.inprocess`).  Either way:

1. every rank resolves the same configuration (a bad option: rank 0 says so once, every rank exits 2);
2. set-up steps run on every rank, collectively (:func:`collectively`): rank 0 checks the run directory
   and reads what a Dirichlet split needs, every rank builds the same session, each client rank loads
   its clients' data (and a resumed run's checkpoint, which rank 0 verifies), and only then does rank 0
   write into the run directory; a failure anywhere is printed once by rank 0, every rank exits, and
   nothing on disk has changed;
3. rank 0 serves (:func:`mpifl.server.serve.serve`), the others host clients
   (:class:`mpifl.client.host.ClientHost`); a failure while training ends the whole job promptly
   (``Comm.abort``: ``MPI_Abort``, or every thread of an in-process run) from the failing rank, after
   that rank printed its one line (the traceback of a bug goes to ``<run>/traceback-rank<k>.txt``);
4. a stop signal (SIGTERM, SIGUSR1, SIGINT) on any rank ends the run at the next round with a checkpoint
   and exit code 75 (:mod:`mpifl.process.signals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, TypeVar

import torch

from ..client.devices import deterministic_kernels, pick_device, threads_for, training_cores
from ..client.host import ClientHost
from ..data import ensure_dataset
from ..data.manifest import build_of
from ..errors import MpiflError
from ..plan.config import RunConfig
from ..process.abort import ABORT_SECONDS, EXIT_LOST
from ..process.faults import maybe_inject
from ..process.signals import EXIT_STOPPED, StopRequest
from ..process.world import launched_world
from ..rundir.checkpoint import Checkpoint, committed_round
from ..rundir.checkpoint import load as load_checkpoint
from ..rundir.checkpoint import verify as verify_checkpoint
from ..rundir.directory import check_new, config_digest, default_run_dir
from ..rundir.names import CONFIG, METRICS, SUMMARY_CSV, SUMMARY_MD, holdout_fold
from ..rundir.rundir import RunDir, write_fold_table
from ..server.folding import fold_threads
from ..server.run_log import fold_summary, read_records
from ..server.serve import serve
from ..server.tracking.live import Tracking, check_installed
from ..session.session import Session, make_session, read_labels
from ..transport.comm import Comm, TimedOut
from ..transport.inprocess import run_threads
from ..transport.topology import NodeLayout, affinity

T = TypeVar("T")
IN_PROCESS_RANKS = 2  # a run without a launcher: the server and one client host


def start(build: Callable[[], tuple[RunConfig, list[str]]], show_manifest: bool, resume: str | None) -> None:
    """Run the command on this process's rank (or, without a launcher, on every rank, as threads), then end this
    rank's part of the job (:meth:`PeerWatch.end`), as every rank does when it exits, with or without an error."""
    stop = StopRequest()  # a stop signal seen by this process (acted upon by rank 0 between rounds)
    stop.install()  # first thing: a stop signal during start-up must not kill a rank
    _, size = launched_world()
    if size == 1:  # this thread will be rank 0: it must never form an OpenMP team (mpifl.transport.inprocess)
        torch.set_num_threads(1)
    comm = None
    if size > 1:
        from ..transport.mpi import MpiComm
        comm = MpiComm()
    watch = PeerWatch(comm)
    try:
        _start(comm, watch, stop, build, show_manifest, resume)
    except SystemExit as exc:  # a refusal while setting up, a stop: every rank exits so
        watch.end(exc.code if isinstance(exc.code, int) else int(exc.code is not None))
        raise
    watch.end(0)


def _start(comm: Comm | None, watch: PeerWatch, stop: StopRequest, build: Callable[[], tuple[RunConfig, list[str]]],
           show_manifest: bool, resume: str | None) -> None:
    rank = comm.rank if comm is not None else 0
    cfg, warnings = configure(comm, build, resume)
    watch.timeout = cfg.peer_timeout
    if comm is not None and cfg.peer_timeout and not show_manifest:
        unwatched = comm.watch_peers(cfg.peer_timeout, watch.lost, watch.ended)
        warnings = warnings + ([unwatched] if unwatched else [])
    if rank == 0:
        for warning in warnings:
            _err(f"mpifl: warning: {warning}")
        if show_manifest:
            from .show_manifest import manifest_text
            try:
                print(manifest_text(cfg))
            except MpiflError as exc:  # the data or the model, found when the session is built
                _err(f"mpifl: error: {exc}")
                sys.exit(exc.exit_code)
    if show_manifest:
        return
    if comm is not None:
        run_rank(cfg, comm, stop, resume is not None, watch)
    else:
        run_threads(IN_PROCESS_RANKS, lambda comm: run_rank(cfg, comm, stop, resume is not None))


def configure(comm: Comm | None, build: Callable[[], tuple[RunConfig, list[str]]],
              resume: str | None) -> tuple[RunConfig, list[str]]:
    """The run's configuration; a bad one is said once and every rank exits.  Over MPI every rank reads the
    options and files itself, so the ranks agree first (:func:`collectively`): a file that one rank cannot
    read must not leave the others waiting."""

    def checked():
        cfg, warnings = build()
        if resume and cfg.holdout == "all":
            raise MpiflError("--resume takes one fold's run directory (<out>/holdout-<domain>), not --holdout all's")
        return cfg, warnings

    if comm is not None:
        return collectively(comm, lambda: None, checked)
    try:
        return checked()
    except MpiflError as exc:
        _err(f"mpifl: error: {exc}")
        sys.exit(exc.exit_code)


def run_rank(cfg: RunConfig, comm: Comm, stop: StopRequest, resume: bool, watch: PeerWatch | None = None) -> None:
    """One rank's whole job: every fold of ``--holdout all``, or the one run."""
    # the server gives up first, so a hung client is named once by it; a hung server is found by
    # client rank 1, whose abort ends the job well before rank 2's clock (3 s later) runs out
    comm.timeout = cfg.round_timeout + 3 * comm.rank if cfg.round_timeout else None
    out = Path(cfg.out) if cfg.out else default_run_dir(cfg)  # --out, or a new name under runs/
    if cfg.holdout == "all":
        _run_all_folds(cfg, out, comm, stop, watch)
    else:
        _run(cfg, out, comm, stop, watch, resume=resume)
    maybe_inject(rank=comm.rank, client=-1, round_index=cfg.rounds + 2)  # tests: every result is written


def _run_all_folds(cfg: RunConfig, base: Path, comm: Comm, stop: StopRequest, watch: PeerWatch | None) -> None:
    """``--holdout all``: one leave-one-domain-out run per domain, in <base>/holdout-<domain>, then a fold table."""

    def check():
        nonlocal base
        if comm.rank == 0:
            base = check_new(base)
            return ensure_dataset(cfg.data_root, cfg.data)
        return None

    manifest = collectively(comm, lambda: None, check)
    domains = comm.bcast_object(manifest.domains if comm.rank == 0 else None)
    for domain in domains:
        fold = holdout_fold(base, domain)
        _run(dataclasses.replace(cfg, holdout=domain, out=str(fold)), fold, comm, stop, watch)
    if comm.rank == 0:
        table = fold_summary({d: holdout_fold(base, d) for d in domains})
        write_fold_table(base, table)
        print(table)


def _run(cfg: RunConfig, out: Path, comm: Comm, stop: StopRequest, watch: PeerWatch | None,
         resume: bool = False) -> None:
    """One run on this rank, into ``out``.  Rank 0 owns the run directory (:mod:`mpifl.rundir.directory`): it checks
    it while the ranks set up, and writes into it only once every rank has, so a refused run changes nothing on
    disk."""
    # rank 0's run directory, claimed, once it is this run's: where a bug's traceback goes
    opened: RunDir | None = None
    tracking = Tracking([])  # rank 0's live trackers (--track), started once the run may write

    def check_run_dir():
        nonlocal opened, out
        if comm.rank != 0:
            return None
        check_installed(cfg)  # a missing package is refused before anything is looked at or written
        if resume:
            opened = RunDir.claim_resumed(out)
        else:
            out = check_new(out, cfg.holdout)
        return str(out), read_labels(cfg, ensure_dataset(cfg.data_root, cfg.data))

    try:
        # the run directory, and the labels a Dirichlet split needs
        run_dir, labels = comm.bcast_object(collectively(comm, lambda: opened, check_run_dir))
        run_dir = Path(run_dir)
        layout = comm.node_layout()

        def setup_ranks():
            session = make_session(cfg, ensure_dataset(cfg.data_root, cfg.data), num_hosts=comm.size - 1,
                                   labels=labels)
            resumed = (load_checkpoint(run_dir, cfg, len(session.clients), build_of(session.manifest)) if resume
                       else None)
            if resumed and resumed.round >= cfg.rounds:
                raise MpiflError(f"{run_dir} is checkpointed after round {resumed.round}; pass --rounds above "
                                 f"{resumed.round} to continue it")
            if comm.rank == 0:
                if resumed:  # before any rank is told to go on: nothing is touched over a damaged checkpoint
                    verify_checkpoint(run_dir, resumed)
                    read_records(run_dir / METRICS)  # or over records it could not continue
                torch.set_num_threads(1)
                return session, None, resumed
            torch.set_num_threads(threads_for(layout, cfg.threads))
            device = pick_device(cfg.device, layout)
            if cfg.deterministic:
                deterministic_kernels(device)
            return session, ClientHost(session, comm, device, run_dir, resumed,
                                       stop), resumed

        session, host, resumed = collectively(comm, lambda: opened, setup_ranks)

        def open_run_dir():  # every rank is set up: the run may write
            nonlocal opened, tracking
            if comm.rank != 0:
                return None
            metric = session.algo.task.metric
            if resume:  # the trackers first: one that cannot start refuses the run before it writes anything
                tracking = Tracking.start(cfg, opened, metric, resumed)
                archived = opened.reopen(cfg)
                if archived:
                    print(archived)
            else:
                opened = RunDir.create(run_dir, cfg)
                try:
                    tracking = Tracking.start(cfg, opened, metric, resumed)
                except MpiflError:
                    opened.unmake()
                    raise
            if watch is not None:
                watch.run_dir = opened
            if opened.lock is None:
                _err(f"mpifl: warning: the file system of {opened.path} keeps no file locks: a second run given "
                     "the same --out while this one runs is not refused")
            return str(opened.path)

        run_dir = Path(comm.bcast_object(collectively(comm, lambda: opened, open_run_dir)))

        seen = comm.allgather_object(config_digest(run_dir))  # what each rank sees of the directory rank 0 opened

        def check_shared():  # each client rank writes its part of every checkpoint there
            blind = [rank for rank, digest in enumerate(seen) if digest != seen[0]]
            if blind:
                tracking.abandon()
                if comm.rank == 0 and not resume:
                    opened.unmake()
                raise MpiflError(f"--out {run_dir} is not on a file system that every node shares: "
                                 f"{comm.describe(blind)} cannot see the {CONFIG} rank 0 wrote there (on "
                                 f"{comm.host(0)}), and the client ranks write their part of each checkpoint into it; "
                                 "pass an --out on a shared file system")

        collectively(comm, lambda: opened, check_shared)
        held = opened or RunDir(run_dir)  # a client rank's writes its checkpoint files into the directory it opened
        if host is not None:
            host.run_dir = held
        _serve_or_host(cfg, comm, session, host, held, resumed, stop, layout, tracking)
        if comm.rank == 0 and resume and cfg.holdout:
            _refresh_fold_table(run_dir, cfg.holdout, session.manifest.domains)
    finally:
        if opened is not None:
            opened.release()


def _refresh_fold_table(run_dir: Path, holdout: str, domains: list[str]) -> None:
    """A fold of ``--holdout all`` continued by ``--resume``: the fold table of its folder, once written, again with
    the fold's new numbers (it would keep the old ones beside a summary that changed)."""
    base = run_dir.parent
    folds = {domain: holdout_fold(base, domain) for domain in domains}
    if (run_dir != folds.get(holdout) or not (base / SUMMARY_MD).is_file()
            or not all((fold / SUMMARY_CSV).is_file() for fold in folds.values())):
        return
    write_fold_table(base, fold_summary(folds))
    print(f"the fold table {base / SUMMARY_MD} now holds this fold's numbers")


def _serve_or_host(cfg: RunConfig, comm: Comm, session: Session, host: ClientHost | None, run_dir: RunDir,
                   resumed: Checkpoint | None, stop: StopRequest, layout: NodeLayout, tracking: Tracking) -> None:
    """This rank's role in the run (rank 0's with its live trackers); a failure ends the whole job, a stop signal
    exits with 75."""
    # where each rank runs, so the log maps a pid that the kernel or the launcher names to a rank
    where = f"pid {os.getpid()}" + (f" thread {threading.current_thread().name}" if comm.in_process else "")
    threads = torch.get_num_threads()
    uploads = ", uploads sent at once (single copy)" if comm.sends_at_once else ""
    # and the cores each uses: rank 0 folds on those its node's client ranks leave
    busy = training_cores(host.device, threads) if host is not None else threads
    ranks = comm.gather_object((f"{where} on {socket.gethostname()}, {threads} threads{uploads}"
                                + (f", {host.placement_note()}" if host else ""), threads, busy, affinity()))
    try:
        if comm.rank == 0:
            processes = [(line, count) for line, count, *_ in ranks]
            folds = fold_threads(layout, cfg.fold_threads, [cores for *_, cores in ranks],
                                 [busy for _, _, busy, _ in ranks])
            if cfg.fold_threads > folds[0]:
                line = (f"mpifl: warning: --fold-threads {cfg.fold_threads} is more than the {folds[0]} cores rank 0 "
                        f"may run on: it folds on {folds[0]}")
                _err(line)
                run_dir.log(line + "\n")
            stopped_by = serve(cfg, comm, session, run_dir, resumed, stop, processes, folds, tracking)
        else:
            host.run()
            stopped_by = host.stopped
    except MpiflError as exc:
        _err(f"mpifl: error: {exc}")
        comm.abort(exc.exit_code)
    except Exception as exc:  # a bug: one line here, the traceback in the run directory
        _err(_crash_line(comm.rank, exc, run_dir))
        comm.abort(1)
    if stopped_by:
        # no rank leaves before rank 0 has committed the checkpoint and said so: a launcher may end the whole
        # job as soon as one process exits non-zero (Open MPI's does)
        comm.arrive("rank 0 to commit the stop's checkpoint")
        sys.exit(EXIT_STOPPED)


class PeerWatch:
    """What this rank does when a peer is lost (:meth:`Comm.watch_peers`, ``--peer-timeout``): rank 0 names the
    ranks and their hosts, and what is left to resume from, on stderr and in ``log.txt``, tells the client ranks,
    and ends the job (exit 69); a client rank that lost rank 0 says so and ends.  And how a rank ends its part of
    the job (:meth:`end`)."""

    def __init__(self, comm: Comm | None, timeout: float = 0.0):
        self.comm, self.timeout = comm, timeout
        self.run_dir: RunDir | None = None  # the run under way, once its directory is open

    def lost(self, ranks: list[int], seconds: float, error: str | None) -> None:
        comm = self.comm
        if comm.rank == 0:
            self._say(f"mpifl: error: lost {comm.describe(ranks)}: {self._silence(ranks, seconds, error)}; "
                      f"{self._left()}")
            comm.end_job()
        else:
            _err(f"mpifl: error: {comm.describe([comm.rank])} lost the server, {comm.describe([0])}: "
                 f"{self._silence([0], seconds, error)}; this rank ends")
        comm.abort(EXIT_LOST)

    def ended(self) -> None:
        """Rank 0 ends the job for a lost peer, and said so: its ``MPI_Abort`` follows, through the launcher, which
        then ends this rank; a rank whose launcher is gone (Open MPI's, after it lost a node) ends by itself.  Not
        at once: a rank ending on its own first may keep the launcher waiting for the lost node."""
        time.sleep(ABORT_SECONDS)
        os._exit(EXIT_LOST)

    def end(self, code: int) -> None:
        """This rank's part of the job is done, and it exits with ``code``: it says goodbye to its peers and ends
        the MPI library, without waiting for a node lost meanwhile, whose finalization would never end.

        A peer silent for ``--peer-timeout`` S (1.25 S on a client rank) while they say goodbye
        (:meth:`Comm.goodbye`) was lost as the job ended: rank 0 says so in one line (also in ``log.txt``), with
        what the run left, and ends the job through ``MPI_Abort`` with ``code`` (its results are whatever the job
        made them: a finished run's are all written); a client rank that lost rank 0 likewise, with exit 69 (whether
        the run finished, rank 0 alone knows).  Once every peer has said goodbye, the library's finalization gets S
        (1.25 S) more; past that the rank ends without it (rank 0 says so).  So a rank ends within S of a lost peer's
        last word, plus ``ABORT_SECONDS`` for an abort that cannot reach the launcher (or S for a finalization cut
        short)."""
        comm = self.comm
        if comm is None:
            return
        from ..transport.liveness import CLIENT_MARGIN  # an MPI job's: mpi4py's MPI is there

        lost = comm.goodbye()
        seconds = self.timeout * (1 if comm.rank == 0 else CLIENT_MARGIN) if self.timeout else None
        if lost:
            if comm.rank == 0:
                self._say(f"mpifl: warning: lost {comm.describe(lost)} as the job ended: "
                          f"{self._silence(lost, seconds, None)}; {self._outcome(code)}; the job ends without "
                          f"{'it' if len(lost) == 1 else 'them'}")
                comm.abort(code)
            _err(f"mpifl: warning: {comm.describe([comm.rank])} lost the server, {comm.describe([0])}, as the job "
                 f"ended: {self._silence([0], seconds, None)}; this rank ends")
            comm.abort(EXIT_LOST)  # whether the run finished, rank 0 alone knows
        comm.finalize(seconds, lambda: self._overdue(code, seconds))

    def _overdue(self, code: int, seconds: float) -> None:
        """The MPI library's finalization has waited ``seconds``: end this process (rank 0 says why)."""
        if self.comm.rank == 0:
            self._say(f"mpifl: warning: the MPI library's finalization did not end within {seconds:g} s "
                      f"(--peer-timeout {self.timeout:g}): a node was lost as the job ended; {self._outcome(code)}; "
                      "this rank ends without it")
        sys.stdout.flush()
        os._exit(code)

    def _say(self, line: str) -> None:
        """Rank 0's line, on stderr and in the run's ``log.txt``."""
        if self.run_dir is not None:
            self.run_dir.log(line + "\n", best_effort=True)
        _err(line)

    def _silence(self, ranks: list[int], seconds: float, error: str | None) -> str:
        """Why ``ranks`` count as lost."""
        one = len(ranks) == 1
        heard = (f"nothing heard from {'it' if one else 'them'} for over {seconds:g} s (--peer-timeout "
                 f"{self.timeout:g})" if error is None else f"the MPI library reports its connection failed ({error})")
        nodes = ("its node or this one" if self.comm.rank else "its node") if one else "their nodes"
        return f"{heard}: {nodes} failed or {'is' if one else 'are'} cut off the network"

    def _outcome(self, code: int) -> str:
        """What the job leaves, ending with exit ``code``."""
        if code == 0:
            return "every result is written" + (f" ({self.run_dir.path})" if self.run_dir is not None else "")
        if code == EXIT_STOPPED:
            return self._left()
        return f"it ends with exit {code}"

    def _left(self) -> str:
        """What the run can continue from."""
        if self.run_dir is None:
            return "nothing was written: run again on nodes that answer"
        done = committed_round(self.run_dir.path)
        if done is None:
            return "no checkpoint was taken (--ckpt-every N takes them): run again with another --out"
        return (f"the checkpoint after round {done} is intact: continue with --resume {self.run_dir.path} on the nodes "
                "that remain")


def collectively(comm: Comm, run_dir: Callable[[], RunDir | None], step: Callable[[], T]) -> T:
    """Run a set-up step on every rank; if any rank failed, rank 0 prints the first failure once and all exit."""
    error = None
    result = None
    with comm.in_turn():
        try:
            result = step()
        except MpiflError as exc:
            error = (str(exc), exc.exit_code)
        except Exception as exc:
            error = (_crash_line(comm.rank, exc, run_dir()), 1)
    try:
        comm.arrive("the other ranks to finish setting up")
    except TimedOut as exc:  # a --round-timeout shorter than the set-up: the first rank to give up says so
        _err(f"mpifl: error: timed out after {exc.seconds:g} s waiting for {comm.describe(exc.missing)} to finish "
             "setting up: --round-timeout must exceed the set-up and the longest round; raise it (0: no limit)")
        comm.abort(exc.exit_code)
    errors = comm.allgather_object(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        rank, (message, code) = failed[0]
        if comm.rank == 0:
            where = f" (rank {rank})" if rank and not message.startswith("mpifl: rank") else ""
            _err(message if message.startswith("mpifl: ") else f"mpifl: error: {message}{where}")
        sys.exit(code)
    return result


def _crash_line(rank: int, exc: BaseException, run_dir: RunDir | None) -> str:
    text = "".join(traceback.format_exception(exc))
    where = "above"
    if run_dir is not None:
        where = f"in {run_dir.write_traceback(rank, text)}"
    else:
        sys.stderr.write(text)
    return f"mpifl: rank {rank} failed: {type(exc).__name__}: {exc} (traceback {where})"


def _err(line: str) -> None:
    with contextlib.suppress(OSError):  # a launcher that is gone (a lost node) reads no more
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
