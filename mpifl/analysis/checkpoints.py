"""Client and server models rebuilt from a run's checkpoint, for the analyses.

A checkpoint (:mod:`mpifl.rundir.checkpoint`, written with ``--ckpt-every N`` or when
a signal stops a run) holds, after round R's aggregation:

* ``server.pt``: the server state, i.e. the model entries the method shares
  (for FedAvg the whole model, BN running statistics averaged; for FedBN
  every entry but the BN layers) and the method's extra tensors;
* ``rank-K.zip``: every trained client's private state, i.e. the entries its method
  keeps local (FedBN: all BN entries; SiloBN: BN running statistics;
  FedStein: BN affine; gPerXAN: PerXAN BN sides; SingleSet: everything;
  FedAvg: only BN step counters); a client that never trained has the initial state.

So two kinds of client model can be had (``--models``):

* ``checkpoint``: the *personal* model as the run evaluates it, shared
  entries from ``server.pt`` plus the client's private entries; exact, no
  computation.  For a method without private layers (FedAvg, FedProx,
  FedWon ...) every client's model is then the global model: what differs
  between clients after *local training* (their weights and BN statistics
  before averaging) is not stored, because the server averages the uploads
  and keeps only the result.
* ``local``: each client's *local* model after one more round of local
  training from the checkpoint (round R+1, with the run's seeded batch order
  and the method's hooks, exactly as the run's client ranks would train it),
  i.e. the models FedWon compares (Fig. 1b/12: client BN statistics, Fig. 5:
  client local models).  It needs the dataset, and costs one local round per
  analysed client.

The *server* model is ``server.pt``'s shared entries; entries it does not
have (a method's private layers: FedBN's BN, SiloBN's statistics ...) are
the average over all clients of their checkpointed private values
(integer step counters: client 0's), the choice FedWon makes for FedBN's
global model (Appendix B.2, Table 12).  :attr:`Checkpointed.server_note`
says when that happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from mpifl.algorithms import ClientState, all_options, get_algorithm
from mpifl.client.private_store import PrivateStore
from mpifl.data import ensure_dataset
from mpifl.data.manifest import build_of
from mpifl.errors import MpiflError
from mpifl.plan.config import RunConfig, read_config_file, resolve
from mpifl.rundir.checkpoint import UnusableCheckpoint, load_adopted, load_clients, load_server, verify
from mpifl.rundir.checkpoint import load as load_meta
from mpifl.rundir.names import CONFIG
from mpifl.session.session import Session, make_session, read_labels

MODEL_SOURCES = ("local", "checkpoint")


def run_config(run_dir: Path, data_root: str | None = None) -> RunConfig:
    """The run's configuration from its ``config.json`` (``data_root`` overrides the recorded one)."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise MpiflError(f"{run_dir} has no config.json; pass the run directory of a run with a checkpoint")
    flat = read_config_file(path)
    algo = get_algorithm(flat.get("algo", RunConfig.algo))
    declared = {o.name: o for o in algo.options}
    known = {k: v for k, v in flat.items() if k not in all_options() or k in declared}
    cfg = resolve(known, {"data_root": data_root} if data_root else {}, declared)
    return cfg


@dataclass
class Checkpointed:
    """A run's session, checkpoint round, server state and every client's private state."""

    run_dir: Path
    cfg: RunConfig
    session: Session
    round: int
    server: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor]
    private: dict[int, dict[str, torch.Tensor]]
    device: torch.device
    server_note: str = ""
    _data: dict = field(default_factory=dict)

    @property
    def algo(self):
        return self.session.algo

    def domain(self, cid: int) -> str:
        return self.session.clients[cid].domain

    def build(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """The run's network holding ``state`` (in eval mode, on the analysis device)."""
        model = self.session.build_model()
        model.load_state_dict(state)
        return model.to(self.device).eval()

    def download(self) -> dict[str, torch.Tensor]:
        """What the server would send in round R+1 (its phase's shared entries and extra tensors)."""
        from mpifl.algorithms import ServerState

        self.algo.enter_round(self.round + 1)
        return {k: v.detach().clone() for k, v in
                self.algo.download(ServerState(model=dict(self.server), extra=dict(self.extra))).items()}

    def personal_state(self, cid: int) -> dict[str, torch.Tensor]:
        """Shared entries from the checkpoint's server state + the client's private entries."""
        down = self.download()
        private = self.private[cid]
        private = {**private, **{k: down[k].clone() for k in self.algo.adopted_keys}}
        return {**{k: down[k] for k in self.algo.shared_keys}, **{k: private[k] for k in self.algo.private_keys}}

    def server_state(self) -> dict[str, torch.Tensor]:
        """The global model: server entries, and the client average for the entries the server lacks."""
        down = self.download()
        state = {k: down[k] for k in self.algo.shared_keys}
        trainers = [int(c) for c in self.session.training_ids]
        averaged = []
        for key in self.algo.private_keys:
            values = [self.private[c][key] for c in trainers]
            if values[0].is_floating_point():
                state[key] = torch.stack([v.double() for v in values]).mean(0).to(values[0].dtype)
                averaged.append(key)
            else:
                state[key] = values[0].clone()
        self.server_note = (f"{len(averaged)} entries the server does not hold ({_summarize(averaged)}) are the "
                            f"average of the {len(trainers)} training clients' checkpointed values") if averaged else ""
        return state

    def local_state(self, cid: int) -> dict[str, torch.Tensor]:
        """The client's model after one round (R+1) of local training from the checkpoint, as its rank would
        train it (seeded batch order, transforms and torch generator of (seed, client, R+1), the method's hooks,
        the run's precision; ``--compile`` is not applied, which may change the last bits)."""
        from mpifl.client.precision import Precision
        from mpifl.client.training import client_round, load_state

        cfg, algo = self.cfg, self.algo
        spec = self.session.clients[cid]
        if not spec.trains:
            raise MpiflError(f"client {cid} ({spec.domain}) is a held-out domain: it never trains, so it has "
                             "no local model; leave it out of --clients")
        down = {k: v.to(self.device) for k, v in self.download().items()}
        client = ClientState(spec=spec, private={k: v.clone().to(self.device) for k, v in self.private[cid].items()})
        client.private.update({k: down[k].clone() for k in algo.adopted_keys})
        model = self.session.build_model().to(self.device)
        if cfg.channels_last:
            model.to(memory_format=torch.channels_last)
        slots = model.state_dict()
        load_state(slots, algo, down, client.private)
        client_round(model, slots, algo, client, self._client_data()[cid], down, self.round + 1, cfg,
                     Precision(cfg.precision, self.device, cfg.channels_last))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def client_data(self, cid: int):
        return self._client_data()[cid]

    def _client_data(self) -> dict:
        """Every client's data (normalized as the run normalizes it), loaded once."""
        if not self._data:
            from mpifl.client.client_data import load_client_data
            from mpifl.client.transforms import TrainTransforms
            from mpifl.plan.config import parse_names

            cfg, session = self.cfg, self.session
            self._data = load_client_data(cfg.data_root, session.manifest, session.clients, self.device,
                                          stream_above_gib=cfg.stream_above,
                                          transforms=TrainTransforms(parse_names(cfg.train_transforms)),
                                          input_norm=cfg.input_norm)
            session.inputs.attach(session.clients, self._data, self.device)
            for exchange in session.exchanges:  # as the run's one-time exchanges, every client here
                spec = exchange.setup_exchange()
                if spec is not None:
                    rows = [exchange.setup_contribution(ClientState(spec=session.clients[c], private={}), self._data[c])
                            for c in session.training_ids.tolist()]
                    exchange.setup_received(torch.stack([r.detach().to(spec.dtype) for r in rows]).to(self.device))
        return self._data


def describe(ckpt: Checkpointed, models: str) -> tuple[str, str]:
    """(long, short) description of the compared models, for the console and for figure titles."""
    clients = (f"after one more local round (round {ckpt.round + 1})" if models == "local"
               else "personal models as checkpointed")
    long = f"checkpoint of round {ckpt.round}; client models: {clients}" + \
        (f"; server: {ckpt.server_note}" if ckpt.server_note else "")
    short = f"round-{ckpt.round} checkpoint; clients: " + \
        ("local models after one more round" if models == "local" else "checkpointed personal models") + \
        ("; server: its entries + the clients' average for its missing ones" if ckpt.server_note else "")
    return long, short


def _summarize(keys: list[str]) -> str:
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def load_checkpointed(run_dir: str | Path, data_root: str | None = None, device: str = "cpu") -> Checkpointed:
    """The run in ``run_dir`` at its checkpoint (``checkpoint/meta.json``), its files verified first; tensors
    loaded with ``torch.load(weights_only=True)`` (:mod:`mpifl.rundir.checkpoint`)."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir, data_root)
    manifest = ensure_dataset(cfg.data_root, cfg.data)
    session = make_session(cfg, manifest, num_hosts=1, labels=read_labels(cfg, manifest))
    try:
        meta = load_meta(run_dir, cfg, len(session.clients), build_of(manifest))
        verify(run_dir, meta)
        server = load_server(run_dir, meta)
        store = PrivateStore(session.algo, {c.id: c for c in session.clients}, session.initial, torch.device("cpu"),
                             budget_gib=float("inf"), rank=0)
        store.restore(load_clients(run_dir, meta, [c.id for c in session.clients]), load_adopted(run_dir, meta))
    except UnusableCheckpoint as exc:
        raise exc.advising("there is nothing to analyse in it; analyse a run whose checkpoint is intact (its "
                           "metrics.jsonl stays readable by python -m mpifl.report)") from None
    private = {c.id: store.peek(c.id).private for c in session.clients}  # the initial state if never trained
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise MpiflError("--device cuda, but no CUDA device is visible; use --device cpu")
    return Checkpointed(run_dir=run_dir, cfg=cfg, session=session, round=meta.round, server=server.model,
                        extra=server.extra, private=private, device=torch.device(device))


def pick_clients(ckpt: Checkpointed, given: str | None) -> list[int]:
    """``--clients 0,3``; default: the first training client of each domain (one per domain)."""
    training = [c for c in ckpt.session.clients if c.trains]
    if given:
        try:
            ids = [int(x) for x in given.split(",") if x.strip()]
        except ValueError:
            raise MpiflError(f"--clients takes client ids separated by commas (e.g. 0,1), got {given!r}")
        bad = [i for i in ids if i not in {c.id for c in training}]
        if bad:
            raise MpiflError(f"--clients {bad}: no such training client; ids are "
                             f"{', '.join(str(c.id) for c in training)}")
        return ids
    first: dict[str, int] = {}
    for c in training:
        first.setdefault(c.domain, c.id)
    return list(first.values())


def client_states(ckpt: Checkpointed, clients: list[int], source: str) -> dict[int, dict[str, torch.Tensor]]:
    """Each client's model state: ``local`` (after one local round) or ``checkpoint`` (personal model)."""
    if source not in MODEL_SOURCES:
        raise MpiflError(f"--models must be one of {', '.join(MODEL_SOURCES)}")
    if source == "checkpoint":
        return {c: ckpt.personal_state(c) for c in clients}
    return {c: ckpt.local_state(c) for c in clients}
