"""A method that says its global model is every client's (``global_model_shared``) gives, after a client trained,
the global model of a client that never did: any rank may score any client's share of its evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpifl.client.training import load_state
from mpifl.plan.clients import ClientSpec

from ..helpers import local_round, make_algo

SHARED = [("copa", {}, {}), ("fedbabu", {}, {}), ("gperxan", {"holdout": "d"}, {}),
          ("fedstein", {"holdout": "d"}, {}), ("fixbn", {}, {"fixbn_stage_rounds": 1}), ("fedavg", {}, {})]


def _spec(cid):
    return ClientSpec(id=cid, domain="a", rows={split: np.arange(8) for split in ("train", "val", "test")})


@pytest.mark.parametrize("name,cfg,options", SHARED, ids=[name for name, _, _ in SHARED])
def test_a_trained_clients_global_model_is_a_fresh_clients(name, cfg, options):
    algo, model = make_algo(name, cfg, **options)
    algo.bind_clients([_spec(0), _spec(1)])
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    server = algo.init_server(initial)
    if name == "fixbn":  # the second stage: BN statistics adopted from the last download that held them
        algo.enter_round(2)
        adopted = {k: server.model[k] + 0.5 for k in algo.adopted_keys}
        algo.enter_round(3)
    else:
        algo.enter_round(1)
        adopted = {}
    assert algo.global_model_shared
    download = algo.download(server)
    torch.manual_seed(0)
    batch = (torch.randn(8, 3, 28, 28), torch.randint(0, 10, (8,)))
    trained, fresh = (algo.init_client(_spec(c), initial) for c in (0, 1))
    for client in (trained, fresh):
        client.private.update({k: v.clone() for k, v in adopted.items()})
    local_round(algo, model, trained, download, steps=3, batch=batch)
    own = [k for k in algo.private_keys if not k.endswith("num_batches_tracked")]
    assert name == "fedavg" or any(not torch.equal(trained.private[k], fresh.private[k]) for k in own) or \
        name in ("fedbabu", "fixbn")  # their own entries stay as they were, by their rule
    slots = model.state_dict()
    outputs = []
    for client in (trained, fresh):
        algo.begin_eval(model, 1)
        load_state(slots, algo, download, algo.global_private(client, download))
        model.eval()
        with torch.no_grad():
            outputs.append(model(batch[0]))
    assert torch.equal(*outputs)
