"""Building an algorithm the way the runtime does, on a small model, for unit tests."""

import numpy as np
import torch

from mpifl.algorithms import Uploads, get_algorithm
from mpifl.client.training import client_round, load_state
from mpifl.plan.config import RunConfig
from mpifl.server.folding import Folding
from mpifl.transport.messages import CLIENT_META
from mpifl.models import build_model, state_entries

from ..conftest import run_here


def make_algo(name, cfg_kw=None, *, model="smallcnn", image_size=(28, 28), **options):
    """(algorithm, model): ``cfg_kw`` sets RunConfig fields, ``options`` the method's options."""
    cls = get_algorithm(name)
    cfg = RunConfig(algo=name, **(cfg_kw or {}),
                    algo_options={**{o.name: o.default for o in cls.options}, **options})
    net = build_model(model, num_classes=10, image_size=image_size, norm=cls.norm, conv=cls.conv)
    return cls(cfg, state_entries(net)), net


def client_meta(samples, steps=1):
    """The ``Uploads.meta`` records of clients with these training sample counts and local steps."""
    meta = np.zeros(len(samples), dtype=CLIENT_META)
    meta["num_samples"] = meta["seen"] = samples
    meta["num_steps"] = steps
    return meta


def model_uploads(per_client, samples):
    """The ``Uploads`` of clients 0..K-1 with these model entries (dicts of arrays) and training sample counts."""
    return Uploads(clients=np.arange(len(samples)), meta=client_meta(samples, steps=4),
                   tensors={k: [u[k] for u in per_client] for k in per_client[0]})


def moved_models(model_state, n, rng):
    """``n`` clients' models: every entry of ``model_state`` plus N(0, 0.1) noise, float32 arrays."""
    return [{k: (v.double().numpy() + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in model_state.items()}
            for _ in range(n)]


def gradients_after_shift(algo, model, shift=1.0):
    """Move every parameter ``shift`` away from where ``begin_local`` anchored it, with zero loss
    gradients, and return the gradients the method's ``after_backward`` leaves (its correction alone)."""
    algo.begin_local(None, model, {})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift)
            p.grad = torch.zeros_like(p)
    algo.after_backward(None, model)
    return [p.grad for p in model.parameters()]


class Batches:
    """A client's training data that yields the same given mini-batches every epoch."""

    def __init__(self, batches):
        self.batches = batches

    def train_batches(self, rng, batch_size):
        return iter(self.batches)


def local_round(algo, model, client, download, steps, loss_fn=None, batch=None):
    """One client round through the runtime's own code (``load_state``, ``client_round``): ``steps``
    mini-batches of ``batch`` (x, y) under the method's loss, or with the objective ``loss_fn(model)``
    instead; the upload as numpy arrays."""
    if loss_fn is not None:
        algo.batch_loss = lambda client, model, x, y: (loss_fn(model), torch.zeros(len(y), 1))
        batch = (torch.zeros(1), torch.zeros(1, dtype=torch.long))
    slots = model.state_dict()
    load_state(slots, algo, download, client.private)
    upload, _ = client_round(model, slots, algo, client, Batches([batch] * steps), download, 1, algo.cfg)
    return {k: v.detach().numpy().copy() for k, v in upload.items()}


def own_options(algo: str, style_model) -> tuple[str, ...]:
    """What a method needs in the small runs of the tests (``test_registry``'s round of every method, ``test_run``'s
    two): a staged one stays in its first stage; FedBABU fine-tunes 1 epoch, not 5, before each of its personal
    evaluations; CCST gets random AdaIN weights and, since a VGG pass per image is slow on a CPU, 32 images per
    client in one version each."""
    return {"fixbn": ("--fixbn-stage-rounds", "2"), "fedbabu": ("--fedbabu-finetune-epochs", "1"),
            "ccst": ("--style-model", str(style_model), "--ccst-k", "1", "--samples-per-client", "32")}.get(algo, ())


def run_two_rounds(data_root, run, algo, *extra):
    """A real run of two rounds in this process (the in-process transport), 10 clients at fraction 0.5 (partial participation), into ``run``."""
    job = run_here("--data-root", str(data_root), "--model", "smallcnn", "--out", str(run), "--algo", algo,
                 "--rounds", "2", "--fraction", "0.5", "--clients-per-domain", "2", "--threads", "1",
                 "--lr", "0.05", "--momentum", "0.9", *extra)
    assert job.returncode == 0, job.stderr


def aggregate(algo, server, uploads, window=None):
    """The server's aggregation of ``uploads`` whose every tensor is in memory: :meth:`prepare`, the
    method's reductions folded ``window`` clients at a time (None: all at once), :meth:`aggregate`."""
    algo.prepare(server, uploads)
    folding = Folding(algo.reductions(server, uploads))
    k = len(uploads.clients)
    for start in range(0, k, window or k):
        folding.add([{name: values[i] for name, values in uploads.tensors.items()}
                     for i in range(start, min(k, start + (window or k)))])
    uploads.sums = folding.sums
    algo.aggregate(server, uploads)
