"""FedRep: head epochs with the body frozen, then body epochs with the head frozen; only the body travels."""

import numpy as np
import torch

from .helpers import make_algo, local_round

HEAD = {"classifier.weight", "classifier.bias"}


def test_only_the_body_travels_and_the_head_is_personal():
    algo, model = make_algo("fedrep")
    assert HEAD <= set(algo.private_keys) and not HEAD & set(algo.shared_keys)
    assert set(algo.uploaded_keys) == set(algo.shared_keys) and algo.evaluates == ("personal",)


def test_head_epochs_then_body_epochs():
    algo, _ = make_algo("fedrep", {"local_epochs": 2}, fedrep_head_epochs=3)
    assert algo.local_epochs() == 5
    head = next(e for e in algo.entries if e.is_head)
    body = next(e for e in algo.entries if e.key == "conv1.weight")
    assert [algo.trainable(head, epoch) for epoch in range(5)] == [True, True, True, False, False]
    assert [algo.trainable(body, epoch) for epoch in range(5)] == [False, False, False, True, True]


def _spec():
    from mpifl.plan.clients import ClientSpec
    return ClientSpec(id=0, domain="d", rows={"train": np.arange(4), "val": np.arange(0), "test": np.arange(0)})


def _moved(epochs):
    """One round of the real local loop with 1 head epoch, stopped after ``epochs`` epochs:
    (whether the head moved, the body parameters that moved, all body parameters)."""
    torch.manual_seed(0)
    algo, model = make_algo("fedrep", {"lr": 0.1, "local_epochs": 1}, fedrep_head_epochs=1)
    algo.local_epochs = lambda: epochs
    before = {k: v.clone() for k, v in model.state_dict().items()}
    client = algo.init_client(_spec(), before)
    up = local_round(algo, model, client, {k: before[k] for k in algo.shared_keys}, 1,
                     batch=(torch.randn(4, 3, 28, 28), torch.arange(4)))
    body = {k for k, _ in model.named_parameters()} - HEAD
    head_moved = any(not torch.equal(client.private[k], before[k]) for k in HEAD)
    return head_moved, {k for k in body if not np.array_equal(up[k], before[k].numpy())}, body


def test_in_the_real_loop_a_head_epoch_moves_only_the_head_and_a_body_epoch_the_body():
    head_moved, body_moved, _ = _moved(epochs=1)
    assert head_moved and not body_moved
    head_moved, body_moved, body = _moved(epochs=2)
    assert head_moved and body_moved == body
