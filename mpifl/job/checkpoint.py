"""Checkpoints: ``--ckpt-every N``, a stop on SIGUSR1/SIGTERM, and ``--resume RUN_DIR``.

Layout, inside the run directory::

    checkpoint/meta.json          which round is complete, and of what run
    checkpoint/round-R/server.pt  the server state after round R's aggregation
    checkpoint/round-R/rank-K.pt  client rank K's hosted clients' private state, by client id

A checkpoint of round R is taken between R's aggregation and R+1's
training: the server writes ``server.pt`` before it broadcasts round R+1's
message, whose header asks every client rank to save first; the gather that
answers the message proves every ``rank-K.pt`` is on disk, and only then is
``meta.json`` replaced (temp file + rename) and older rounds deleted.  So the
checkpoint that ``meta.json`` names is always complete, whatever fails when.

No generator state is saved because none exists across rounds: every
random draw comes from generators seeded by (seed, round) or (seed, client,
round) (``mpifl.plan.seeding``), so a resumed run repeats the uninterrupted run
bit for bit.  Private state is saved per client id, so a run can resume on
another number of ranks (the clients are placed again).  Round R's record,
which waits for the evaluation riding on round R+1's message, is saved in
``meta.json`` and completed by the resumed run.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..algorithms import ServerState
from ..plan.config import RunConfig
from ..errors import MpiflError

FORMAT = 1
DIRNAME = "checkpoint"
IDENTITY = ("algo", "data", "model", "seed", "clients_per_domain", "num_clients", "dirichlet", "samples_per_client",
            "percent", "holdout")  # what makes a checkpoint belong to a run


@dataclass
class Checkpoint:
    """What ``meta.json`` says: the complete round and what the run was."""

    round: int
    clients: int
    ranks: dict[int, list[int]]  # client rank -> the client ids in its file
    pending: dict | None  # round ``round``'s metrics record, waiting for its evaluation
    identity: dict

    def to_json(self) -> dict:
        return {"format": FORMAT, "round": self.round, "clients": self.clients,
                "ranks": {str(k): v for k, v in self.ranks.items()}, "pending": self.pending,
                "identity": self.identity}


def round_dir(run_dir: Path, round_index: int) -> Path:
    return Path(run_dir) / DIRNAME / f"round-{round_index}"


def _atomic_save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_server(run_dir: Path, round_index: int, state: ServerState) -> None:
    _atomic_save({"model": state.model, "extra": state.extra}, round_dir(run_dir, round_index) / "server.pt")


def save_clients(run_dir: Path, round_index: int, rank: int, private: dict[int, dict[str, torch.Tensor]]) -> None:
    """One client rank's hosted clients' private tensors (moved to CPU), keyed by client id."""
    cpu = {cid: {k: v.detach().cpu() for k, v in tensors.items()} for cid, tensors in private.items()}
    _atomic_save(cpu, round_dir(run_dir, round_index) / f"rank-{rank}.pt")


def commit(run_dir: Path, checkpoint: Checkpoint) -> None:
    """Make round ``checkpoint.round`` the checkpoint (every file of it is written), drop older rounds."""
    base = Path(run_dir) / DIRNAME
    tmp = base / "meta.json.tmp"
    tmp.write_text(json.dumps(checkpoint.to_json(), indent=1) + "\n")
    os.replace(tmp, base / "meta.json")
    for old in base.glob("round-*"):
        if old.name != f"round-{checkpoint.round}":
            shutil.rmtree(old, ignore_errors=True)


def identity(cfg: RunConfig) -> dict:
    """The options a resumed run must share with the checkpointed one (method options included)."""
    return {**{k: getattr(cfg, k) for k in IDENTITY}, **cfg.algo_options}


def load(run_dir: Path, cfg: RunConfig, num_clients: int) -> Checkpoint:
    """``meta.json`` of RUN_DIR, checked against the run about to continue it."""
    path = Path(run_dir) / DIRNAME / "meta.json"
    if not path.exists():
        raise MpiflError(f"no checkpoint in {run_dir} (no {DIRNAME}/meta.json); it was run without --ckpt-every "
                         "and never stopped by a signal, so it can only be run again from the start")
    raw = json.loads(path.read_text())
    if raw.get("format") != FORMAT:
        raise MpiflError(f"checkpoint {path} has format {raw.get('format')}, this mpifl reads {FORMAT}; "
                         "resume it with the mpifl version that wrote it")
    saved = raw["identity"]
    ours = identity(cfg)
    differ = [k for k in sorted(set(saved) | set(ours)) if saved.get(k) != ours.get(k)]
    if differ:
        what = ", ".join(f"{k} {saved.get(k)!r} vs {ours.get(k)!r}" for k in differ)
        raise MpiflError(f"checkpoint in {run_dir} is of another run ({what}); resume with that run's options "
                         "(they come from its config.json) or start a new run")
    if raw["clients"] != num_clients:
        raise MpiflError(f"checkpoint in {run_dir} has {raw['clients']} clients, this run {num_clients}; "
                         "the dataset changed since; start a new run")
    return Checkpoint(round=raw["round"], clients=raw["clients"], pending=raw["pending"], identity=saved,
                      ranks={int(k): v for k, v in raw["ranks"].items()})


def load_server(run_dir: Path, checkpoint: Checkpoint) -> ServerState:
    raw = torch.load(round_dir(run_dir, checkpoint.round) / "server.pt", weights_only=True)
    return ServerState(model=raw["model"], extra=raw["extra"])


def load_clients(run_dir: Path, checkpoint: Checkpoint, client_ids: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """The private state of ``client_ids``, from whichever rank files hold them."""
    wanted, out = set(client_ids), {}
    for rank, ids in sorted(checkpoint.ranks.items()):
        if wanted.intersection(ids):
            saved = torch.load(round_dir(run_dir, checkpoint.round) / f"rank-{rank}.pt", weights_only=True)
            out.update({cid: saved[cid] for cid in wanted.intersection(ids)})
    missing = sorted(wanted - set(out))
    if missing:
        raise MpiflError(f"checkpoint in {run_dir} lacks the state of clients {missing}; it is damaged, "
                         "start a new run")
    return out
