"""A client rank: hosts a fixed set of logical clients for the whole run.

Each round (docs/design.md, "One round"): receive the download, evaluate if asked (scalars only: this rank's
batches of the global model's evaluation, :mod:`mpifl.session.evaluation`, then the personal models of its
training clients), train the hosted clients of the round one after the other in id order (the round's plan may
cut a client's local steps, lose its upload, or hold it in the client's private state until a later step's
message: :mod:`mpifl.plan.clock`), post each one's summed upload to rank 0 as soon as it is trained (it leaves
at once if rank 0 is receiving it, else at a later post; at most ``SEND_WINDOW_BYTES`` of them held: rank 0
folds them while this rank trains the next), and send the records and small uploads in one gather; the transport's time, bytes moving and waiting for
rank 0, is reported apart from training (``rank.seconds``).  Between clients only tensors are swapped in and
out of one model instance: the download, then the client's private state
(:class:`~mpifl.client.private_store.PrivateStore`: created when the client first trains, on disk beyond
``--private-memory``).  What a message asks of this rank is the round protocol's (:mod:`mpifl.session.protocol`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ..algorithms import ClientState
from ..errors import MpiflError
from ..plan.config import parse_names
from ..plan.seeding import personalization_seeds
from ..process.faults import maybe_inject
from ..process.signals import StopRequest
from ..rundir.checkpoint import Checkpoint, FileRecord, load_adopted, load_clients, save_clients
from ..session.evaluation import EvalBatch, bound
from ..session.protocol import RoundProtocol
from ..session.session import Session
from ..transport.buffers import ReusedBuffer
from ..transport.comm import Comm
from ..transport.exchange import exchange_all
from ..transport.gpu_mpi import device_buffers
from ..transport.messages import CLIENT_META, EVAL_SPLITS, RANK_SECONDS, STOP, Messages, rank_report, record
from .client_data import load_client_data
from .eval_share import EvalShare
from .precision import Precision
from .private_store import PrivateStore
from .training import batch_scores, client_round, evaluate, load_state, train_local
from .transforms import TrainTransforms

NOTHING_SAVED = FileRecord(0, "00" * 32)  # the report of a message that saves nothing
SEND_WINDOW_BYTES = 256 << 20  # trained clients' uploads (at least one) a rank keeps until rank 0 has them


class ClientHost:
    """A client rank's part of a run: its hosted clients' data (on its device), their private state (the
    algorithm's :class:`ClientState`, in this rank's :class:`PrivateStore` and checkpoint files) and one
    model instance they take turns in.  ``run()`` answers every message of the run; ``stopped`` then says
    whether a STOP message ended it early.
    """

    def __init__(self, session: Session, comm: Comm, device: torch.device, run_dir: Path,
                 resumed: Checkpoint | None = None, stop: StopRequest | None = None):
        self.session, self.comm, self.device = session, comm, device
        self.run_dir, self.resumed = run_dir, resumed
        self.stop = stop or StopRequest()  # a stop signal this process received: reported to the server
        self.algo = session.algo
        self.hosted = session.placement[comm.rank - 1]
        specs = [session.clients[c] for c in self.hosted]
        # a held-out domain's images are read where its batches are scored (EvalShare), unless they cannot leave
        kept = [spec for spec in specs if spec.trains or bound(spec, session.algo, session.cfg)]
        self.data = load_client_data(session.cfg.data_root, session.manifest, kept, device,
                                     stream_above_gib=session.cfg.stream_above,
                                     transforms=TrainTransforms(parse_names(session.cfg.train_transforms)),
                                     input_norm=session.cfg.input_norm)
        cfg = session.cfg
        self.precision = Precision(cfg.precision, device, cfg.channels_last)
        self.model = session.build_model().to(device)
        if cfg.channels_last:
            self.model.to(memory_format=torch.channels_last)
        if cfg.compile:  # the feature extractor, where the time goes; forward() and batch_loss call it
            self.model.encode = torch.compile(self.model.encode)
        self.slots = self.model.state_dict()  # tensors aliasing the model's parameters and buffers
        self.specs = {spec.id: spec for spec in specs}
        self.clients = PrivateStore(self.algo, self.specs, session.initial, device, cfg.private_memory, comm.rank)
        if resumed:
            self.clients.restore(load_clients(run_dir, resumed, self.hosted), load_adopted(run_dir, resumed))
        self.share: EvalShare | None = None  # this rank's batches of the global model's evaluation
        self.stopped = False  # the server's STOP message ended the run early
        self.data_seconds = 0.0  # of this round's training, producing batches
        on_gpu = device.type == "cuda"
        self.device_buffers = device_buffers(cfg.gpu_buffers, on_gpu, comm.cuda_aware())
        # on the GPU for a CUDA-aware transport; else page-locked host memory: fast, asynchronous copies to the GPU
        self.down_buffer, self.up_buffer, self.summed_buffer = (
            ReusedBuffer(pinned=on_gpu, device=device if self.device_buffers else None) for _ in range(3))

    def run(self) -> None:
        try:
            self._run()
        except RuntimeError as exc:  # a kernel without a deterministic version, under --deterministic
            if "does not have a deterministic implementation" not in str(exc):
                raise
            raise MpiflError(f"--deterministic: {str(exc).split(', but')[0]} in this model, so its runs cannot "
                             "repeat bit for bit on a GPU; run without --deterministic") from exc
        finally:
            self.clients.close()

    def _run(self) -> None:
        mine = self.session.trainers_by_rank[self.comm.rank - 1]
        self.session.inputs.attach([self.specs[c] for c in self.data], self.data, self.device)
        setup = {c: ClientState(spec=self.specs[c], private={}) for c in mine}  # before any private state exists
        exchange_all(self.comm, self.session.exchanges, self.session.trainers_by_rank,
                     lambda exchange: [exchange.setup_contribution(setup[c], self.data[c]) for c in mine],
                     self.device)
        self.data.update(self.algo.training_data(setup, {c: self.data[c] for c in mine}))
        self._share(self.session.evaluation().scored_by(self.comm.rank))  # its rows read before round 1
        protocol = RoundProtocol(self.session, start=self.resumed.round if self.resumed else 0)
        for r in protocol.rounds():
            messages = protocol.open(r)
            down = self.down_buffer.get(messages.down.nbytes)
            transport = self._transport_seconds()
            self.comm.bcast(down)
            header, download = messages.read_down(down)
            if header.round != r:
                raise RuntimeError(f"rank {self.comm.rank} expected round {r}, the server sent {header.round}")
            saved = NOTHING_SAVED
            if header.saves:  # the state after round r-1, before this message changes anything
                saved = save_clients(self.run_dir, r - 1, self.comm.rank, self.clients.saved_states(),
                                     self.clients.adopted_record())
            download = {k: v.to(self.device, non_blocking=True) for k, v in download.items()}  # no-op on device
            self._synchronize()  # the copies out of a pinned buffer end before it is reused
            self.clients.adopt(download, r)
            plan = protocol.plan(header, messages)
            work = plan.of(self.comm.rank)
            secure = self.session.secure  # --secure-aggregation: the trained clients' uploads go up masked
            masking = secure.open(r, secure.coefficients(self.session.planned(r)), messages) if secure else None
            send = self.up_buffer.get(messages.upload_bytes(len(work.uploads), len(work.evaluates), len(work.scores)))
            report, scored, eval_segments, client_segments = messages.segments(
                send, len(work.uploads), len(work.evaluates), len(work.scores))
            size = messages.summed.nbytes
            # a method that folds after the gather holds its round's uploads until then
            early = not self.algo.reductions_need_results
            slots = min(len(work.uploads), max(1, SEND_WINDOW_BYTES // max(size, 1))) if early else len(work.uploads)
            summed = self.summed_buffer.get(slots * size)
            posted = [None] * slots  # each slot's upload, until rank 0 has it
            segment_of = dict(zip(work.uploads, client_segments))

            start = time.perf_counter()
            if work.evaluates or work.scores:
                self.algo.begin_eval(self.model, header.evaluate)
            if work.scores:
                messages.scores(len(work.scores)).pack({"eval.scores": self._score(work.scores, download)}, out=scored)
            for cid, segment in zip(work.evaluates, eval_segments):
                messages.eval.pack({"client.eval": self._evaluate(self.clients.peek(cid), download,
                                                                  header.evaluate)}, out=segment)
                self.clients.fit_budget()
            evaluated_at = time.perf_counter()
            self.data_seconds = 0.0
            before_training = self._transport_seconds()
            sent = 0
            for cid in sorted(set(work.trains) | set(work.uploads)):  # a client's upload goes up in id order
                client = self.clients.get(cid)
                if cid in work.trains:
                    upload = self._train(client, download, r, plan.fate.trains[cid])
                    if masking:
                        upload = masking.mask(plan.uploads, cid, upload)
                    if cid in work.holds:  # its step is a later message's (asynchronous aggregation)
                        _hold(client, messages, upload)
                if cid in segment_of:  # else held, or its upload is lost (--drop-after)
                    slot = sent % slots
                    if posted[slot] is not None:
                        self.comm.complete([posted[slot]])
                    part = summed[slot * size:(slot + 1) * size]
                    if cid in work.trains:
                        messages.pack_client(upload, segment_of[cid], part)
                    else:
                        _release(client, segment_of[cid], part)
                    if size:
                        if self.device_buffers:
                            self._synchronize()  # the send reads the GPU buffer only once the packing kernels are done
                        posted[slot] = self.comm.post(part)
                    sent += 1
                self.clients.fit_budget()
            sending = [handle for handle in posted if handle is not None]
            if early:
                self.comm.complete(sending)
            trained_at = time.perf_counter()
            moving, waiting = self._transport_seconds()
            uploading = moving + waiting - sum(before_training)  # posting and completing the uploads
            seconds = record(RANK_SECONDS, train=trained_at - evaluated_at - uploading, evaluate=evaluated_at - start,
                             data=self.data_seconds, communication=moving - transport[0],
                             waiting=waiting - transport[1])
            messages.rank.pack(rank_report(seconds, self.stop.signum, saved.nbytes, saved.sha256, self.device),
                               out=report)
            counts = [0] * self.comm.size
            counts[self.comm.rank] = send.nbytes
            if self.device_buffers:
                self._synchronize()  # the collective reads the GPU buffer only once the packing kernels are done
            self.comm.gatherv(send, counts)
            if not early:
                self.comm.complete(sending)
            if header.action == STOP:
                self.stopped = True
                return

    def _transport_seconds(self) -> tuple[float, float]:
        """This rank's seconds in the transport so far: (bytes moving, waiting for other ranks)."""
        return self.comm.seconds_moving, self.comm.seconds_waiting

    def placement_note(self) -> str:
        """Where this rank computes and where its messages live, for ``log.txt``."""
        where = "on the GPU" if self.device_buffers else "pinned" if self.device.type == "cuda" else "host memory"
        return f"{self.device}, message buffers {where}"

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _train(self, client: ClientState, download: dict[str, torch.Tensor], round_index: int,
                max_steps: int | None) -> dict:
        """One client's round (``max_steps``: its local steps, cut by a deadline; None: its full local work)."""
        load_state(self.slots, self.algo, download, client.private)
        if maybe_inject(rank=self.comm.rank, client=client.id, round_index=round_index) == "nan":
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        upload, stats = client_round(self.model, self.slots, self.algo, client, self.data[client.id], download,
                                     round_index, self.session.cfg, self.precision, max_steps)
        self.data_seconds += stats.data_seconds
        val_correct = val_seen = 0
        if self.algo.selection == "local-val":  # the post-training local model, before aggregation
            _, val_correct, val_seen = evaluate(self.model, self.data[client.id], "val",
                                                self.session.cfg.eval_batch_size, self.precision, self.algo.task)
        upload = self.session.privacy.privatize(upload, download, client.id, round_index)
        upload["client.meta"] = record(CLIENT_META, num_samples=client.spec.num_train, num_steps=stats.steps,
                                       loss_sum=stats.loss_sum, correct=stats.correct, seen=stats.seen,
                                       val_correct=val_correct, val_seen=val_seen, dp_epsilon=stats.epsilon)
        return upload

    def _fitter(self, client: ClientState, round_index: int):
        """``fit(optimizer, epochs, trainable=None)`` for :meth:`Algorithm.personalize`: the local training loop
        on the client's training split, on the model as loaded, seeded by (seed, client, the round evaluated);
        ``trainable(entry, epoch)`` replaces the method's own freezing rule."""
        cfg = self.session.cfg

        def fit(optimizer: torch.optim.Optimizer, epochs: int, trainable=None) -> None:
            rng, torch_seed = personalization_seeds(cfg.seed, client.id, round_index)
            torch.manual_seed(torch_seed)
            train_local(self.model, self.algo, client, self.data[client.id], optimizer, epochs, cfg.batch_size,
                        rng, round_index, self.precision, trainable)

        return fit

    def _score(self, batches: tuple[EvalBatch, ...], download: dict[str, torch.Tensor]) -> torch.Tensor:
        """(batches, [loss sum, score sum]) float64 of this rank's batches of the global model's evaluation; the
        model of each client's run of them is the download with ``global_private`` of the client's state here, or,
        for a client hosted elsewhere, of its initial state (the same model: :mod:`mpifl.session.evaluation`)."""
        scores, current = [], None
        for batch, x, y in self._share(batches):
            if batch.client != current:
                if current in self.specs:
                    self.clients.fit_budget()
                current = batch.client
                client = (self.clients.peek(current) if current in self.specs else
                          self.clients.fresh(self.session.clients[current]))
                load_state(self.slots, self.algo, download, self.algo.global_private(client, download))
                self.model.eval()
            scores.append(torch.stack(batch_scores(self.model, x, y, self.precision, self.algo.task)))
        if current in self.specs:
            self.clients.fit_budget()
        return torch.stack(scores).cpu()

    def _share(self, batches: tuple[EvalBatch, ...]) -> EvalShare:
        """This rank's share of the global model's evaluation: made at set-up, again if a stage moves batches."""
        if self.share is None or self.share.batches != batches:
            self.share = None  # its images go before the next share's come
            self.share = EvalShare(self.session.cfg.data_root, self.session.manifest, self.session.clients,
                                   batches, self.data, self.device, self.session.cfg.input_norm,
                                   self.session.cfg.stream_above)
        return self.share

    def _evaluate(self, client: ClientState, download: dict[str, torch.Tensor], round_index: int) -> torch.Tensor:
        """(personal model kind, split, [loss sum, score sum, count]) for one training client; the model is first
        personalized by the method (:meth:`Algorithm.personalize`; by default left as it is)."""
        out = torch.zeros(self.session.evaluation().personal_kinds, len(EVAL_SPLITS), 3, dtype=torch.float64)
        for k in range(len(out)):
            load_state(self.slots, self.algo, download, client.private)
            self.algo.personalize(client, self.model, self._fitter(client, round_index))
            for s, split in enumerate(EVAL_SPLITS):
                out[k, s] = torch.tensor(evaluate(self.model, self.data[client.id], split,
                                                  self.session.cfg.eval_batch_size, self.precision, self.algo.task),
                                         dtype=torch.float64)
        return out


# the packed upload of a client whose step is a later message's, kept with its private state (so checkpoints,
# spilling and a resume on other ranks carry it) until then
HELD = ("held.gathered", "held.summed")


def _hold(client: ClientState, messages: Messages, upload: dict[str, torch.Tensor]) -> None:
    """Pack ``upload`` into the client's private state, for :func:`_release` in its step's message."""
    gathered = torch.empty(messages.client.nbytes, dtype=torch.uint8)
    summed = torch.empty(messages.summed.nbytes, dtype=torch.uint8)
    messages.pack_client(upload, gathered, summed)
    client.private.update(zip(HELD, (gathered, summed)))


def _release(client: ClientState, gathered, summed) -> None:
    """Copy the client's held upload into its buffers of this message, and drop it from its state."""
    for out, held in zip((gathered, summed), (client.private.pop(key) for key in HELD)):
        if isinstance(out, torch.Tensor):
            out.copy_(held)
        else:
            np.copyto(out, held.cpu().numpy())
