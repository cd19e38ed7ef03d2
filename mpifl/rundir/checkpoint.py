"""Checkpoints: ``--ckpt-every N``, a stop on SIGUSR1/SIGTERM, and ``--resume RUN_DIR``.

Layout, inside the run directory::

    checkpoint/meta.json          which round is complete, and of what run
    checkpoint/round-R/server.pt  the server state after round R's aggregation
    checkpoint/round-R/rank-K.zip client rank K's hosted clients' private state: one member per client
                                  that has trained (``client-ID.pt``) and the adopted entries (``adopted.pt``)

A checkpoint of round R is taken between R's aggregation and R+1's
training: the server writes ``server.pt`` before it broadcasts round R+1's
message, whose header asks every client rank to save first; the gather that
answers the message proves every ``rank-K.zip`` is on disk, and only then is
``meta.json`` replaced (temp file + rename) and older rounds deleted.  So the
checkpoint that ``meta.json`` names is always complete, whatever fails when.  Every file is written to a
temporary name, flushed to disk and renamed, into the run directory as the run opened it (:mod:`.files`: a
failed write, a full disk say, leaves no temporary file and ends the run in one line, the last checkpoint kept);
its size and sha256, computed while writing, are recorded in
``meta.json`` (a client rank's come back to the server in the gather), and :func:`verify` checks them all
before a resumed run touches anything, so a file cut short or changed is named instead of half-loaded.

No generator state is saved because none exists across rounds: every
random draw comes from generators seeded by (seed, round) or (seed, client,
round) (``mpifl.plan.seeding``), so a resumed run repeats the uninterrupted run
bit for bit.  Private state is saved per client id, so a run can resume on
another number of ranks (the clients are placed again); a client that has never trained has none (its state is
the initial one, :mod:`mpifl.client.private_store`), and the states are written and read one client at a time, so
a checkpoint needs memory for one client's state beyond ``--private-memory``.  Round R's record,
which waits for the evaluation riding on round R+1's message, is saved in
``meta.json`` and completed by the resumed run.
"""

from __future__ import annotations

import fnmatch
import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..algorithms import ServerState
from ..data.manifest import build_difference, sha256_file
from ..errors import MpiflError
from ..models.pretrained import UnreadableWeights, load_weights_only
from ..plan.config import RESUMABLE, RunConfig
from .files import FileRecord, Folder
from .names import ADOPTED_MEMBER, CHECKPOINT, CHECKPOINT_META, CLIENT_MEMBER, RANK_FILE, ROUND_DIR, SERVER_FILE

FORMAT = 4  # 2: every file's size and sha256; 3: one member per client; 4: identity = every option but RESUMABLE


@dataclass
class Checkpoint:
    """What ``meta.json`` says: the complete round, what the run was, and every file of the round."""

    round: int
    clients: int
    ranks: dict[int, list[int]]  # client rank -> the client ids in its file
    pending: dict | None  # round ``round``'s metrics record, waiting for its evaluation
    identity: dict
    files: dict[str, FileRecord]  # file name in round-R/ -> its record
    # optional, so that a meta.json of format 4 written before them still loads (None: not recorded)
    data: dict | None = None  # the data build trained on (mpifl.data.manifest.build_of)
    threads: list[int] | None = None  # each client rank's torch threads
    tracking: dict[str, str] | None = None  # --track: each tracker's run, which a resumed run continues
    # not in meta.json: the server's state as verify read it (rank 0, before the run writes), until load_server
    server: ServerState | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {"format": FORMAT, "round": self.round, "clients": self.clients,
                "ranks": {str(k): v for k, v in self.ranks.items()}, "pending": self.pending,
                "identity": self.identity, "data": self.data, "threads": self.threads, "tracking": self.tracking,
                "files": {name: {"bytes": f.nbytes, "sha256": f.sha256} for name, f in self.files.items()}}


def round_dir(run_dir: Path, round_index: int) -> Path:
    return Path(run_dir) / CHECKPOINT / ROUND_DIR.format(round=round_index)


def rank_file(rank: int) -> str:
    return RANK_FILE.format(rank=rank)


def _member(cid: int) -> str:
    return CLIENT_MEMBER.format(client=cid)


def _folder(run_dir: Folder | Path) -> Folder:
    """The run directory to write into: held by the caller (a :class:`~.files.Folder`), or opened now."""
    return run_dir if isinstance(run_dir, Folder) else Folder(run_dir)


def _round_file(round_index: int, name: str) -> str:
    return f"{CHECKPOINT}/{ROUND_DIR.format(round=round_index)}/{name}"


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save_server(run_dir: Folder | Path, round_index: int, state: ServerState) -> FileRecord:
    return _folder(run_dir).write(_round_file(round_index, SERVER_FILE),
                                  lambda f: torch.save({"model": state.model, "extra": state.extra}, f))


def save_clients(run_dir: Folder | Path, round_index: int, rank: int,
                 states: Iterable[tuple[int, dict[str, torch.Tensor]]], adopted: dict) -> FileRecord:
    """One client rank's file: an uncompressed zip of one ``torch.save`` per (client id, private tensors) of
    ``states``, written as they come (one state in memory at a time), and the adopted entries
    (:meth:`PrivateStore.adopted_record`)."""
    def write(f) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr(ADOPTED_MEMBER, _saved(adopted))
            for cid, private in states:
                archive.writestr(_member(cid), _saved({k: v.detach().cpu() for k, v in private.items()}))

    return _folder(run_dir).write(_round_file(round_index, rank_file(rank)), write)


def commit(run_dir: Folder | Path, checkpoint: Checkpoint) -> None:
    """Make round ``checkpoint.round`` the checkpoint (every file of it is written), drop older rounds."""
    folder = _folder(run_dir)
    folder.write_text(f"{CHECKPOINT}/{CHECKPOINT_META}", json.dumps(checkpoint.to_json(), indent=1) + "\n")
    for old in folder.names(CHECKPOINT):
        if fnmatch.fnmatchcase(old, ROUND_DIR.format(round="*")) and old != ROUND_DIR.format(round=checkpoint.round):
            folder.remove_tree(f"{CHECKPOINT}/{old}")


RESUME_ADVICE = "it cannot be resumed; start the run again with another --out (its metrics.jsonl stays as it is)"


class UnusableCheckpoint(MpiflError):
    """A checkpoint that is not there or cannot be read as it was written: ``damage`` says what, the message adds
    what to do, a resume's by default; another use (the analyses) names its own with :meth:`advising`."""

    def __init__(self, damage: str, advice: str = RESUME_ADVICE):
        super().__init__(f"{damage}; {advice}")
        self.damage = damage

    def advising(self, advice: str) -> "UnusableCheckpoint":
        return UnusableCheckpoint(self.damage, advice)


def committed_round(run_dir: Path) -> int | None:
    """The round of ``run_dir``'s committed checkpoint (None: none, or ``meta.json`` unreadable)."""
    try:
        return int(json.loads((Path(run_dir) / CHECKPOINT / CHECKPOINT_META).read_text())["round"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def identity(cfg: RunConfig) -> dict:
    """The options a resumed run must share with the checkpointed one: every option, method options included,
    but those a resume may change (:data:`mpifl.plan.config.RESUMABLE`) and ``out`` (where the run directory
    is; a run moved elsewhere resumes there)."""
    return {k: v for k, v in cfg.to_flat().items() if k not in RESUMABLE and k != "out"}


def load(run_dir: Path, cfg: RunConfig, num_clients: int, data: dict | None = None) -> Checkpoint:
    """``meta.json`` of RUN_DIR, checked against the run about to continue it (``data``: the build of its dataset
    under ``--data-root``, :func:`~mpifl.data.manifest.build_of`)."""
    path = Path(run_dir) / CHECKPOINT / CHECKPOINT_META
    if not path.exists():
        again = "it can only be run again from the start, with another --out"
        uncommitted = sorted((Path(run_dir) / CHECKPOINT).glob(ROUND_DIR.format(round="*")),
                             key=lambda p: int(p.name.rpartition("-")[2]))
        if uncommitted:  # a run that ended while writing its first checkpoint; the next commit removes it
            raise UnusableCheckpoint(f"no committed checkpoint in {run_dir}: {CHECKPOINT}/{uncommitted[-1].name}/ was "
                                     f"still being written when the run ended (no {CHECKPOINT}/{CHECKPOINT_META} "
                                     "commits it)", again)
        raise UnusableCheckpoint(f"no checkpoint in {run_dir} (no {CHECKPOINT}/{CHECKPOINT_META}): it was run without "
                                 "--ckpt-every and never stopped by a signal", again)
    checkpoint = _parse(path)
    ours = identity(cfg)
    differ = [k for k in sorted(set(checkpoint.identity) | set(ours)) if checkpoint.identity.get(k) != ours.get(k)]
    if differ:
        what = ", ".join(f"{k} {checkpoint.identity.get(k)!r} vs {ours.get(k)!r}" for k in differ)
        raise MpiflError(f"checkpoint in {run_dir} is of another run ({what}); resume with that run's options "
                         "(they come from its config.json) or start a new run")
    if checkpoint.clients != num_clients:
        raise MpiflError(f"checkpoint in {run_dir} has {checkpoint.clients} clients, this run {num_clients}; "
                         "the dataset changed since; start a new run")
    changed = build_difference(checkpoint.data, data) if checkpoint.data and data else None
    if changed:
        raise MpiflError(f"checkpoint in {run_dir} was taken on another build of {cfg.data} than the one in "
                         f"--data-root {cfg.data_root} ({changed}); resume with the data the run started on, or "
                         "start a new run")
    return checkpoint


def _parse(path: Path) -> Checkpoint:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UnusableCheckpoint(f"checkpoint {path} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else None
        raise MpiflError(f"checkpoint {path} has format {found}, this mpifl reads {FORMAT}; "
                         "resume it with the mpifl version that wrote it")
    try:
        return Checkpoint(round=int(raw["round"]), clients=int(raw["clients"]), pending=raw["pending"],
                          identity=dict(raw["identity"]), ranks={int(k): list(v) for k, v in raw["ranks"].items()},
                          files={name: FileRecord(int(f["bytes"]), str(f["sha256"]))
                                 for name, f in raw["files"].items()},
                          data=raw.get("data"), threads=raw.get("threads"),
                          tracking={str(k): str(v) for k, v in (raw.get("tracking") or {}).items()} or None)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UnusableCheckpoint(f"checkpoint {path} lacks or garbles {exc}") from None


def verify(run_dir: Path, checkpoint: Checkpoint) -> None:
    """Every file of the checkpoint is there with the size and sha256 ``meta.json`` recorded; else one line
    naming the first file that is not (sizes first: a file cut short is found without reading the rest).  Then the
    server's state is read (:func:`load_server` takes it), so that a server file that cannot be loaded (one that
    holds objects whose loading could run code) is refused here, before a resumed run writes anything; the client
    ranks read theirs while they set up."""
    folder = round_dir(run_dir, checkpoint.round)
    expected = [SERVER_FILE] + [rank_file(rank) for rank in sorted(checkpoint.ranks)]
    unrecorded = [name for name in expected if name not in checkpoint.files]
    if unrecorded:
        raise UnusableCheckpoint(f"checkpoint {folder.parent / CHECKPOINT_META} records no {unrecorded[0]}: the "
                                "checkpoint is damaged")

    def refuse(name: str, problem: str):
        return UnusableCheckpoint(f"checkpoint file {folder / name} {problem}: the checkpoint of round "
                                 f"{checkpoint.round} is damaged")

    for name in expected:
        path, record = folder / name, checkpoint.files[name]
        if not path.is_file():
            raise refuse(name, "is missing")
        if path.stat().st_size != record.nbytes:
            raise refuse(name, f"has {path.stat().st_size} bytes, {record.nbytes} when it was written")
    for name in expected:
        if sha256_file(folder / name) != checkpoint.files[name].sha256:
            raise refuse(name, "differs from what was written (sha256)")
    checkpoint.server = _read_server(run_dir, checkpoint)


def _unreadable(path: Path, exc: Exception) -> MpiflError:
    reason = str(exc) if isinstance(exc, UnreadableWeights) else f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return UnusableCheckpoint(f"cannot load checkpoint file {path} ({reason})")


def _torch_load(path: Path, member: str | None = None):
    """``path`` (or its zip ``member``) read weights-only (:func:`~mpifl.models.pretrained.load_weights_only`: no
    code runs, torch's words stay out); one line if unreadable."""
    try:
        if member is None:
            return load_weights_only(path)
        with zipfile.ZipFile(path) as archive:
            return load_weights_only(io.BytesIO(archive.read(member)))
    except Exception as exc:  # whatever torch or zipfile raises for a file it cannot read
        raise _unreadable(path, exc) from None


def _read_server(run_dir: Path, checkpoint: Checkpoint) -> ServerState:
    path = round_dir(run_dir, checkpoint.round) / SERVER_FILE
    raw = _torch_load(path)
    if not (isinstance(raw, dict) and {"model", "extra"} <= set(raw)):
        raise UnusableCheckpoint(f"checkpoint file {path} holds no server state (model and extra)")
    return ServerState(model=raw["model"], extra=raw["extra"])


def load_server(run_dir: Path, checkpoint: Checkpoint) -> ServerState:
    """The server's state at the checkpoint: the one :func:`verify` read (handed over, not kept twice), else read
    now."""
    state, checkpoint.server = checkpoint.server, None
    return state if state is not None else _read_server(run_dir, checkpoint)


def load_clients(run_dir: Path, checkpoint: Checkpoint,
                 client_ids: list[int]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(client id, private tensors) of those of ``client_ids`` that had trained, one at a time, from whichever
    rank files hold them (the others have the initial state)."""
    wanted = set(client_ids)
    for rank, ids in sorted(checkpoint.ranks.items()):
        path = round_dir(run_dir, checkpoint.round) / rank_file(rank)
        mine = sorted(wanted.intersection(ids))
        if mine:
            try:
                with zipfile.ZipFile(path) as archive:
                    held = set(archive.namelist())
            except Exception as exc:
                raise _unreadable(path, exc) from None
            for cid in mine:
                if _member(cid) in held:
                    yield cid, _torch_load(path, _member(cid))


def load_adopted(run_dir: Path, checkpoint: Checkpoint) -> dict:
    """The adopted entries at the checkpoint (every rank's file holds the same)."""
    return _torch_load(round_dir(run_dir, checkpoint.round) / rank_file(min(checkpoint.ranks)), ADOPTED_MEMBER)
