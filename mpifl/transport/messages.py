"""The byte layouts of one round's two messages.

Down (one ``Bcast``): a header (command, round, which round to evaluate)
followed by the algorithm's download tensors.

Up, first one ``Gatherv``: each client rank sends, in this order,
  1. its report: timings (``rank.seconds``), its peak resident and GPU memory so far (``rank.peak_rss``,
     ``rank.peak_gpu``), the
     stop signal it received, if any (``rank.stop``, so that a signal reaching one rank stops the whole
     job), and, when the header asked it to save, the size and sha256 of the checkpoint file it wrote
     (``rank.saved_bytes``, ``rank.saved_sha256``),
  2. if the header asked for evaluation, the float64 (loss sum, score sum) of
     each batch of the global model's evaluation it scored, in plan order
     (:mod:`mpifl.session.evaluation`: rank 0 adds them up per client and
     split), then one ``client.eval`` block per client whose personal models
     it evaluates, ascending id: personal model kind x split (val, test) x
     (loss sum, score sum, count),
  3. one block per client of the round it hosts, ascending id: the uploads
     the algorithm gathers (``SharePolicy.gathered``: small tensors its rule
     needs from every client) and ``client.meta`` (samples, steps, train
     loss sum, correct, seen, DP-SGD epsilon).
And one point-to-point message per client of the round: its other uploads
(``summed``), posted as soon as the client is trained, which rank 0 receives
in client-id order over all ranks, a few at a time, and folds into the
algorithm's sums (:mod:`mpifl.algorithms.core.reduction`) while the clients train
(after the gather for a method whose sums need the clients' results), so that
neither side holds the round's uploads at once.
Both sides derive every size from the placement and the round's sample, so
no sizes travel.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from .wire import Buffer, TensorSpec, WireLayout

if TYPE_CHECKING:
    from .share import SharePolicy

TRAIN, FINAL, STOP = 1, 2, 3  # header commands: train a round / evaluate and stop / stop (a signal)
SAVE = 8  # flag on a command: first save your clients' state, the checkpoint of the round before
NO_EVAL = -1
EVAL_SPLITS = ("val", "test")
# Records of named float64 fields, travelling as plain float64 vectors:
# val_correct/val_seen: the post-training local model on the client's val split (--select-by local-val; else 0);
# dp_epsilon: the client's DP-SGD epsilon over its records so far (--dpsgd-clip; else 0)
CLIENT_META = np.dtype([(f, np.float64) for f in ("num_samples", "num_steps", "loss_sum", "correct", "seen",
                                                  "val_correct", "val_seen", "dp_epsilon")])
# a client rank's round: training (without posting its uploads; data: producing batches, within train),
# evaluation, and its time in the transport from the broadcast to the gather: moving bytes, waiting for others
RANK_SECONDS = np.dtype([(f, np.float64) for f in ("train", "evaluate", "data", "communication", "waiting")])

_HEADER = [TensorSpec("round.command", (), torch.int64), TensorSpec("round.index", (), torch.int64),
           TensorSpec("round.evaluate", (), torch.int64)]


@dataclass(frozen=True)
class Header:
    command: int  # TRAIN, FINAL or STOP, possibly | SAVE
    round: int
    evaluate: int  # round whose global model is in this download and must be evaluated, or NO_EVAL

    @property
    def action(self) -> int:
        return self.command & ~SAVE

    @property
    def saves(self) -> bool:
        return bool(self.command & SAVE)


class Messages:
    """Layouts shared by the server and the client ranks."""

    def __init__(self, policy: SharePolicy, personal_kinds: int):
        self.down = WireLayout(_HEADER + policy.download)
        gathered = set(policy.gathered)
        if not gathered <= {s.name for s in policy.upload}:
            raise ValueError(f"gathered entries {sorted(gathered)} are not all uploaded")
        self.client = WireLayout([s for s in policy.upload if s.name in gathered] + [
            TensorSpec("client.meta", (len(CLIENT_META.names),), torch.float64)])
        self.summed = WireLayout([s for s in policy.upload if s.name not in gathered])
        self.eval = WireLayout([TensorSpec("client.eval", (personal_kinds, len(EVAL_SPLITS), 3), torch.float64)])
        self.rank = WireLayout([TensorSpec("rank.seconds", (len(RANK_SECONDS.names),), torch.float64),
                                TensorSpec("rank.peak_rss", (), torch.int64),
                                TensorSpec("rank.peak_gpu", (), torch.int64),
                                TensorSpec("rank.stop", (), torch.int64),
                                TensorSpec("rank.saved_bytes", (), torch.int64),
                                TensorSpec("rank.saved_sha256", (32,), torch.uint8)])
        self.download_names = [s.name for s in policy.download]
        self.gathered_names = [s.name for s in policy.upload if s.name in gathered]
        self.policy_down_bytes = sum(s.nbytes for s in policy.download)
        self.policy_up_bytes = sum(s.nbytes for s in policy.upload)

    def upload_bytes(self, num_trained: int, num_evaluated: int, num_scored: int) -> int:
        """A client rank's bytes in the gather: its report, the scores of ``num_scored`` batches, ``num_evaluated``
        personal evaluation blocks and ``num_trained`` clients' gathered uploads."""
        return (self.rank.nbytes + self.scores(num_scored).nbytes + num_evaluated * self.eval.nbytes
                + num_trained * self.client.nbytes)

    @staticmethod
    def scores(num_scored: int) -> WireLayout:
        """A client rank's scores of its batches of the global model's evaluation: (loss sum, score sum) each."""
        return WireLayout([TensorSpec("eval.scores", (num_scored, 2), torch.float64)])

    def pack_client(self, upload: dict[str, torch.Tensor], gathered: Buffer, summed: Buffer) -> None:
        """One trained client's upload (its tensors and ``client.meta``): the gathered part into its block of
        the gather, the rest into its point-to-point message."""
        if set(upload) != set(self.client.names) | set(self.summed.names):
            raise ValueError(f"upload {sorted(upload)} does not match the share policy "
                             f"{sorted(self.client.names + self.summed.names)}")
        self.client.pack({name: upload[name] for name in self.client.names}, out=gathered)
        self.summed.pack({name: upload[name] for name in self.summed.names}, out=summed)

    def pack_down(self, header: Header, download: dict[str, torch.Tensor], out: np.ndarray) -> None:
        scalars = {"round.command": header.command, "round.index": header.round, "round.evaluate": header.evaluate}
        self.down.pack({**{k: torch.tensor(v) for k, v in scalars.items()}, **download}, out=out)

    def read_down(self, buf: Buffer) -> tuple[Header, dict[str, torch.Tensor]]:
        """The header and zero-copy tensors of the download."""
        views = self.down.unpack(buf)
        header = Header(int(views["round.command"]), int(views["round.index"]), int(views["round.evaluate"]))
        return header, {name: torch.as_tensor(views[name]) for name in self.download_names}

    def segments(self, buf: Buffer, num_trained: int, num_evaluated: int, num_scored: int):
        """Byte slices (report, batch scores, [personal eval per client], [upload per trained client]) of one rank's
        upload."""
        s, e, c = self.rank.nbytes, self.eval.nbytes, self.client.nbytes
        first = s + self.scores(num_scored).nbytes
        base = first + num_evaluated * e
        if buf.nbytes != base + num_trained * c:
            raise ValueError(f"upload of {buf.nbytes} bytes, expected {base + num_trained * c}")
        return (buf[:s], buf[s:first], [buf[first + i * e:first + (i + 1) * e] for i in range(num_evaluated)],
                [buf[base + i * c:base + (i + 1) * c] for i in range(num_trained)])


def rank_report(seconds: torch.Tensor, stop_signal: int, saved_bytes: int, saved_sha256: str,
                device: torch.device) -> dict:
    """A client rank's report, the tensors of :attr:`Messages.rank`: its :data:`RANK_SECONDS` record, its peak
    resident memory and peak GPU memory on ``device``, the stop signal it received (0: none), and the size and
    sha256 (hex) of the checkpoint file it wrote (0 and zeros)."""
    return {"rank.seconds": seconds, "rank.peak_rss": torch.tensor(peak_rss()),
            "rank.peak_gpu": torch.tensor(peak_gpu(device)), "rank.stop": torch.tensor(stop_signal),
            "rank.saved_bytes": torch.tensor(saved_bytes),
            "rank.saved_sha256": torch.frombuffer(bytearray.fromhex(saved_sha256), dtype=torch.uint8)}


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_gpu(device: torch.device) -> int:
    """The most GPU memory this process's allocator has held on ``device`` so far, in bytes (0 off a GPU);
    the CUDA context (some 500 MB a process) comes on top."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else 0


def saved_file(report: dict) -> tuple[int, str]:
    """(bytes, sha256 hex) of the checkpoint file a received report says its rank wrote."""
    return int(report["rank.saved_bytes"]), bytes(report["rank.saved_sha256"]).hex()


def record(dtype: np.dtype, **values: float) -> torch.Tensor:
    """One record of ``dtype`` (:data:`CLIENT_META`, :data:`RANK_SECONDS`) as the float64 vector that travels."""
    if set(values) != set(dtype.names):
        raise ValueError(f"record fields {sorted(values)} != {list(dtype.names)}")
    return torch.tensor([values[name] for name in dtype.names], dtype=torch.float64)


def records(vectors: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """The (K,) structured array of ``dtype`` whose rows are K received float64 vectors."""
    flat = np.array(vectors, dtype=np.float64).reshape(len(vectors), len(dtype.names))
    return flat.view(dtype).reshape(len(vectors))
