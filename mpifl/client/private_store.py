"""A client rank's hosted clients' private state: created when first used, in memory up to a budget, on local
disk beyond it (``--private-memory GiB``).

A client's state (:class:`~mpifl.algorithms.ClientState`, what the method keeps: its private model entries,
``extra_private`` tensors, ``--keep-optimizer`` state) is created from the initial model the first time the
client trains.  Before that it is the initial state, which a personal evaluation builds and drops again, so a
rank's memory grows with the clients that have trained, not with the clients it hosts.  When the states in
memory exceed the budget, the least recently used ones go to one file each in a per-rank folder under
``$TMPDIR`` (node-local disk on most clusters; removed when the rank's run ends; a rank killed outright leaves
it, and the next run on the node that spills removes it: a folder is held, :mod:`mpifl.dirlock`, while its rank
lives; the folder's name holds its node's, and a rank removes only its own node's, since a ``$TMPDIR`` that
several nodes share may keep each node's locks to itself) and are read back when next used:
``torch.save``/``torch.load`` round-trip tensors bit for bit, so results do not depend on the budget.

**Adopted entries** (sent down but not back, :attr:`Algorithm.adopted_keys`) are, by definition, every hosted
client's copy of the latest download's value.  Instead of writing them into every client each round, the store
keeps one copy per entry with the round it was last sent (:meth:`adopt`) and writes it into a client's state
when that state is used or saved and has not seen it since (a client that trained after the entry's last
adoption keeps its own value, as it would have).
"""

from __future__ import annotations

import glob
import io
import os
import shutil
import socket
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import torch

from ..algorithms import Algorithm, ClientState
from ..dirlock import DirectoryLock, LocksUnsupported, remove_unheld, try_lock
from ..errors import MpiflError
from ..plan.clients import ClientSpec

SPILL_PREFIX = "mpifl-private-"  # a spill folder: <TMPDIR>/mpifl-private-<host>-rank<k>-<random>
UNCLAIMED_SPILL_SECONDS = 60  # a spill folder without a lock file (its rank not yet holding it) is unheld once this old


def state_bytes(private: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in private.values())


class PrivateStore:
    """The private states of one rank's hosted clients (``specs``, by id), on ``device`` while in memory."""

    def __init__(self, algo: Algorithm, specs: dict[int, ClientSpec], initial: dict[str, torch.Tensor],
                 device: torch.device, budget_gib: float, rank: int):
        self.algo, self.specs, self.initial, self.device = algo, specs, initial, device
        self.budget = budget_gib * 2**30
        self.rank = rank
        self.resident: OrderedDict[int, ClientState] = OrderedDict()  # least recently used first
        self.spilled: set[int] = set()  # created, and in a file of the spill folder
        self.synced: dict[int, int] = {}  # client -> the round whose adopted entries its state holds
        self.adopted: dict[str, tuple[int, torch.Tensor]] = {}  # entry -> (round last sent, value)
        self._bytes: dict[int, int] = {}  # resident client -> its state's bytes when last counted
        self._total = 0  # their sum
        self._used: set[int] = set()  # resident clients handed out since the last count (their state may grow)
        self._spill_dir: Path | None = None
        self._spill_lock: DirectoryLock | None = None  # held while this rank lives (the kernel drops it at death)
        self._check_spill_folder()

    def _check_spill_folder(self) -> None:
        """Set-up, before the run directory is made: if the hosted clients' state can outgrow the budget, the
        folder it would spill to (``$TMPDIR``) must be a writable directory (else one line, nothing written)."""
        where = os.environ.get("TMPDIR")
        if where is None or not self.specs:
            return  # tempfile's own choice, which falls back to a usable folder
        one = state_bytes(self.algo.init_client(next(iter(self.specs.values())), self.initial).private)
        if len(self.specs) * one <= self.budget:
            return
        folder = Path(where)
        problem = ("does not exist" if not folder.exists() else "is not a directory" if not folder.is_dir()
                   else "is not writable" if not os.access(folder, os.W_OK | os.X_OK) else None)
        if problem:
            raise MpiflError(f"--private-memory {self.budget / 2**30:g} GiB: client rank {self.rank}'s "
                             f"{len(self.specs)} clients' private state can outgrow it and would spill to "
                             f"TMPDIR={where}, which {problem}; point TMPDIR at a writable local disk, or raise "
                             "--private-memory")

    # ------------------------------------------------------------ use
    def adopt(self, download: dict[str, torch.Tensor], round_index: int) -> None:
        """Round ``round_index``'s download arrived: its adopted entries are every client's from now on."""
        for key in self.algo.adopted_keys:
            self.adopted[key] = (round_index, download[key].clone())

    def get(self, cid: int) -> ClientState:
        """Client ``cid``'s state, in memory and up to date; created from the initial model on first use."""
        if cid in self.resident:
            self.resident.move_to_end(cid)
            client = self.resident[cid]
        else:
            client = ClientState(spec=self.specs[cid], private=self._read(cid) if cid in self.spilled else
                                 self._initial(self.specs[cid]))
            self.spilled.discard(cid)
            self.resident[cid] = client
        self._used.add(cid)
        self.synced[cid] = self._sync(cid, client.private)
        return client

    def peek(self, cid: int) -> ClientState:
        """``cid``'s state for reading (evaluation); a client never trained gets a throw-away initial one."""
        if cid in self.resident or cid in self.spilled:
            return self.get(cid)
        client = ClientState(spec=self.specs[cid], private=self._initial(self.specs[cid]))
        self._sync(cid, client.private)
        return client

    def fresh(self, spec: ClientSpec) -> ClientState:
        """A client hosted elsewhere as if it had never trained: its initial state with the adopted entries (the
        global model of a method whose global model is every client's, :mod:`mpifl.session.evaluation`)."""
        private = self._initial(spec)
        for key, (_, value) in self.adopted.items():
            private[key] = value.clone()
        return ClientState(spec=spec, private=private)

    def fit_budget(self) -> None:
        """Move least recently used states to disk until those in memory fit the budget; the most recent one,
        in use, stays."""
        for cid in self._used:  # recounted: training may add state (kept optimizer moments)
            counted = state_bytes(self.resident[cid].private)
            self._total += counted - self._bytes.get(cid, 0)
            self._bytes[cid] = counted
        self._used.clear()
        while self._total > self.budget and len(self.resident) > 1:
            cid, client = self.resident.popitem(last=False)
            self._total -= self._bytes.pop(cid)
            self._write(cid, client.private)

    # ------------------------------------------------------------ checkpoints
    def saved_states(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Every created client's state, up to date and on the CPU, one at a time (ascending id); spilled states
        are read back one by one, so saving needs memory for one state beyond the budget."""
        for cid in sorted(set(self.resident) | self.spilled):
            if cid in self.resident:
                private = self.resident[cid].private
                self.synced[cid] = self._sync(cid, private)
                yield cid, {k: v.detach().cpu() for k, v in private.items()}
            else:  # its file stays as it is, and so does what it has seen
                private = self._read(cid)
                self._sync(cid, private)
                yield cid, {k: v.cpu() for k, v in private.items()}

    def adopted_record(self) -> dict:
        """The adopted entries with their rounds, for the checkpoint (the same on every rank)."""
        return {key: (r, value.detach().cpu()) for key, (r, value) in self.adopted.items()}

    def restore(self, states: Iterator[tuple[int, dict[str, torch.Tensor]]], adopted: dict) -> None:
        """A resumed run's states (as :meth:`saved_states` gave them) and adopted entries, placed as use would
        place them: in memory up to the budget, the rest on disk."""
        self.adopted = {key: (int(r), value.to(self.device)) for key, (r, value) in adopted.items()}
        latest = max((r for r, _ in self.adopted.values()), default=-1)
        expected = None  # the entries of a fresh state (the same for every client), built once
        for cid, private in states:
            if expected is None:
                expected = {k: v.shape for k, v in self.algo.init_client(self.specs[cid], self.initial).private.items()}
            for key, shape in expected.items():
                if key not in private or private[key].shape != shape:
                    raise MpiflError(f"checkpointed state of client {cid} lacks {key} {tuple(shape)}; the "
                                     "checkpoint is of another model or method version; start a new run")
            self.resident[cid] = ClientState(spec=self.specs[cid], private={k: v.to(self.device)
                                                                            for k, v in private.items()})
            self._used.add(cid)
            self.synced[cid] = latest  # saved up to date
            self.fit_budget()

    def close(self) -> None:
        """Remove the spill folder (the run ended, or failed) and give it up."""
        if self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            if self._spill_lock is not None:
                self._spill_lock.release()
            self._spill_dir = self._spill_lock = None

    # ------------------------------------------------------------ internals
    def _initial(self, spec: ClientSpec) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in self.algo.init_client(spec, self.initial).private.items()}

    def _sync(self, cid: int, private: dict[str, torch.Tensor]) -> int:
        """Write into ``private`` (client ``cid``'s state) the adopted entries sent since the client last saw
        them; returns the round it has then seen."""
        seen = self.synced.get(cid, -1)
        for key, (r, value) in self.adopted.items():
            if r > seen:
                private[key] = value.clone()
        return max([seen] + [r for r, _ in self.adopted.values()])

    def _folder(self) -> Path:
        """The rank's spill folder, made and claimed on first use, after removing those no live rank holds."""
        if self._spill_dir is None:
            try:
                parent = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())
                node = f"{SPILL_PREFIX}{socket.gethostname()}-rank"
                remove_unheld(parent, f"{glob.escape(node)}*", UNCLAIMED_SPILL_SECONDS)
                self._spill_dir = Path(tempfile.mkdtemp(prefix=f"{node}{self.rank}-", dir=parent))
                try:
                    self._spill_lock = try_lock(self._spill_dir)
                except LocksUnsupported:  # kept no locks: a killed rank's folder stays, as before
                    self._spill_lock = None
            except OSError as exc:
                raise MpiflError(f"--private-memory: cannot create a folder for private state beyond the budget "
                                 f"({exc.strerror}: {exc.filename}); point TMPDIR at a writable local disk, or "
                                 "raise --private-memory") from None
        return self._spill_dir

    def _write(self, cid: int, private: dict[str, torch.Tensor]) -> None:
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in private.items()}, buffer)
        path = self._folder() / f"client-{cid}.pt"
        try:
            path.write_bytes(buffer.getbuffer())
        except OSError as exc:
            raise MpiflError(f"--private-memory: cannot write client {cid}'s private state to {path} "
                             f"({exc.strerror}); free space there (TMPDIR), or raise --private-memory") from None
        self.spilled.add(cid)

    def _read(self, cid: int) -> dict[str, torch.Tensor]:
        path = self._folder() / f"client-{cid}.pt"
        try:
            with path.open("rb") as f:
                saved = torch.load(f, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - missing, cut short, or changed since this rank wrote it
            problem = "is gone" if isinstance(exc, FileNotFoundError) else "cannot be read back"
            raise MpiflError(f"--private-memory: client {cid}'s private state, spilled to {path}, {problem} "
                             f"({type(exc).__name__}): it was removed or damaged while the run went on; "
                             "resume from the last checkpoint (--resume RUN_DIR) to recover it, and keep "
                             "TMPDIR's spill folders while a run lives") from None
        return {k: v.to(self.device) for k, v in saved.items()}
