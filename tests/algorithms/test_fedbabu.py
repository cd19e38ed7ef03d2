"""FedBABU: the body learns under a frozen random head; each client fine-tunes before its personal evaluation."""

import numpy as np
import pytest
import torch

from mpifl.errors import MpiflError
from mpifl.plan.clients import ClientSpec

from ..conftest import read_metrics
from .helpers import local_round, make_algo, run_two_rounds

HEAD = {"classifier.weight", "classifier.bias"}


def _spec():
    return ClientSpec(id=0, domain="d", rows={"train": np.arange(4), "val": np.arange(0), "test": np.arange(0)})


def test_the_head_never_travels_and_never_trains_while_the_body_does():
    torch.manual_seed(0)
    algo, model = make_algo("fedbabu", {"lr": 0.1})
    assert not HEAD & set(algo.shared_keys) and HEAD <= set(algo.private_keys)
    assert algo.evaluates == ("global", "personal")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    client = algo.init_client(_spec(), before)
    up = local_round(algo, model, client, {k: before[k] for k in algo.shared_keys}, 3,
                     batch=(torch.randn(4, 3, 28, 28), torch.arange(4)))
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in HEAD)
    assert not np.array_equal(up["conv1.weight"], before["conv1.weight"].numpy())


@pytest.mark.parametrize("part,head_only", [("full", False), ("head", True)])
def test_personalize_fine_tunes_through_fit_with_its_own_rule(part, head_only):
    algo, model = make_algo("fedbabu", fedbabu_finetune=part, fedbabu_finetune_epochs=4)
    calls = []
    algo.personalize(None, model, lambda optimizer, epochs, rule: calls.append((optimizer, epochs, rule)))
    (optimizer, epochs, rule), = calls
    assert epochs == 4 and isinstance(optimizer, torch.optim.SGD)
    head = next(e for e in algo.entries if e.is_head)
    body = next(e for e in algo.entries if e.key == "conv1.weight")
    assert rule(head, 0) and rule(body, 0) is not head_only
    algo, model = make_algo("fedbabu", fedbabu_finetune_epochs=0)
    algo.personalize(None, model, lambda *args: pytest.fail("no fine-tuning asked for"))


def test_bad_fine_tuning_options_are_refused():
    with pytest.raises(MpiflError, match="--fedbabu-finetune must be one of full, head"):
        make_algo("fedbabu", fedbabu_finetune="body")


@pytest.mark.slow
def test_in_a_real_run_fine_tuned_models_differ_from_the_global_one_and_the_head_stays_put(data_root, tmp_path):
    run_two_rounds(data_root, tmp_path / "r", "fedbabu", "--fedbabu-finetune-epochs", "1")
    record = read_metrics(tmp_path / "r")[-1]
    assert record["bytes"]["down"] == record["bytes"]["up"] > 0
    glob, personal = (record["eval"][kind]["test"]["clients"] for kind in ("global", "personal"))
    assert set(glob) == set(personal) and any(glob[c]["loss"] != personal[c]["loss"] for c in glob)
