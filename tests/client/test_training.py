"""Local training's one line for a non-finite loss names what made it: the model a client started the round from
(the initial weights, or the last aggregation) when its first batch, before any local step, is already non-finite;
local training (--lr) otherwise."""

import math

import numpy as np
import pytest
import torch

from mpifl.algorithms import ClientState
from mpifl.client.training import train_local
from mpifl.errors import MpiflError
from mpifl.plan.clients import ClientSpec

from ..algorithms.helpers import Batches, make_algo


def _train(algo, model, round_index, lr):
    spec = ClientSpec(id=3, domain="mono", rows={s: np.arange(4) for s in ("train", "val", "test")})
    x, y = torch.rand(4, 3, 28, 28), torch.tensor([0, 1, 2, 3])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return train_local(model, algo, ClientState(spec=spec, private={}), Batches([(x, y)] * 3), optimizer, 2, 4,
                       np.random.default_rng(0), round_index)


@pytest.mark.parametrize("round_index", [1, 4])
def test_a_model_that_starts_the_round_non_finite_is_blamed_not_the_local_learning_rate(round_index):
    algo, model = make_algo("fedadam", server_lr=1e30)
    with torch.no_grad():
        next(model.parameters()).fill_(math.inf)  # as a diverged server step leaves it
    with pytest.raises(MpiflError) as refused:
        _train(algo, model, round_index, lr=0.01)
    line = str(refused.value)
    assert f"for client 3 (mono) on its first batch of round {round_index}, before any local step" in line
    if round_index == 1:
        assert line.endswith("the initial model gives it; check the model and the data")
    else:
        assert line.endswith(f"the model it started from (round {round_index - 1}'s aggregation by fedadam, with "
                             "any entries the client keeps) diverged; check the options this run changed "
                             "(--server-lr 1e+30), or lower --lr")


def test_a_loss_that_local_steps_make_non_finite_is_blamed_on_the_learning_rate():
    algo, model = make_algo("fedavg")
    assert math.isfinite(_train(algo, model, 2, lr=0.01).loss_sum)
    algo, model = make_algo("fedavg")
    with pytest.raises(MpiflError, match=r"^loss is (nan|inf) for client 3 \(mono\) in round 2, epoch [12]; lower --lr "
                                         "or check that client's data$"):
        _train(algo, model, 2, lr=1e12)
