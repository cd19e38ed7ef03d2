"""``python -m mpifl.bench --case dp-sgd``: a DP-SGD client's local training in mpifl (:mod:`.dp_sgd`) against a
bare Opacus loop on the same model, data and batch size.

mpifl: :func:`~mpifl.client.training.client_round` of one client, as a client rank runs it each round (the
method's hooks, Poisson batches indexed on the device, Opacus' hooks attached and removed, the accountant loaded
from and stored into the client's private state, its epsilon).  Bare: ``PrivacyEngine.make_private`` once (RDP
accountant, Poisson sampling by its ``DPDataLoader`` over a ``TensorDataset`` of the client's normalized training
images), then per round the local epochs of ``zero_grad``, cross-entropy, ``backward``, ``step``, and the
accountant's epsilon once, as mpifl reports it every round.  Both take
ceil(n / B) steps an epoch at the run's noise and clip, on one device and ``threads`` torch threads; the two are
timed round by round in turn, so slow phases of a shared machine hit both alike, and the first round of each is
warm-up.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

from ..client.client_data import load_client_data
from ..client.training import client_round, load_state
from ..session.session import Session


def dp_sgd_round_seconds(session: Session, rounds: int, device: torch.device) -> dict:
    """Seconds of each measured round (the first dropped), mpifl's and the bare loop's, and the client's size."""
    cfg, algo = session.cfg, session.algo
    spec = next(c for c in session.clients if c.trains)
    data = load_client_data(cfg.data_root, session.manifest, [spec], device, input_norm=cfg.input_norm)[spec.id]
    model = session.build_model().to(device)
    slots = model.state_dict()
    client = algo.init_client(spec, session.initial)
    client.private = {k: v.to(device) for k, v in client.private.items()}
    download = {k: session.initial[k].to(device) for k in algo.shared_keys}

    bare = session.build_model().to(device)
    bare.load_state_dict(session.initial)
    images = torch.cat([x for x, _ in data.eval_batches("train", 1024)])
    labels = torch.cat([y for _, y in data.eval_batches("train", 1024)])
    loader = DataLoader(TensorDataset(images, labels), batch_size=cfg.batch_size)
    engine = PrivacyEngine(accountant="rdp")
    bare, optimizer, loader = engine.make_private(
        module=bare, optimizer=torch.optim.SGD(bare.parameters(), lr=cfg.lr), data_loader=loader,
        noise_multiplier=cfg.dpsgd_noise, max_grad_norm=cfg.dpsgd_clip)
    bare.train()

    times = {"mpifl": [], "bare": []}
    for r in range(1, rounds + 1):
        algo.enter_round(r)
        load_state(slots, algo, download, client.private)
        start = time.perf_counter()
        client_round(model, slots, algo, client, data, download, r, cfg)
        times["mpifl"].append(_since(start, device))
        start = time.perf_counter()
        for _ in range(algo.local_epochs()):
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(bare(x), y).backward()
                optimizer.step()
        engine.get_epsilon(1 / spec.num_train)  # as mpifl reports the client's epsilon every round
        times["bare"].append(_since(start, device))
    return {"train_samples": spec.num_train, **{k: v[1:] for k, v in times.items()}}


def _since(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def dp_sgd_table(result: dict) -> list[str]:
    bare, mpifl = statistics.median(result["bare"]), statistics.median(result["mpifl"])
    return [f"{result['model']} on {result['data']}, --algo {result['algo']}: one client's DP-SGD local training, "
            f"{result['train_samples']} records, batch {result['batch_size']}, {result['local_epochs']} epoch(s); "
            f"{result['device']}, {result['threads']} thread(s); median of {len(result['bare'])} rounds each",
            f"  bare Opacus loop (make_private)  {bare:8.4f} s/round",
            f"  mpifl client_round               {mpifl:8.4f} s/round   ratio to bare {mpifl / bare:5.3f} (fastest "
            f"rounds: {min(result['mpifl']) / min(result['bare']):5.3f})"]
