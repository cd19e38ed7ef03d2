"""FedPer: the last K blocks stay on each client, the base is averaged."""

import pytest

from mpifl.errors import MpiflError

from .helpers import make_algo

HEAD = {"classifier.weight", "classifier.bias"}


def test_default_keeps_the_classifier_and_shares_every_other_entry_but_step_counters():
    algo, model = make_algo("fedper")
    policy = algo.policy()
    assert {s.name for s in policy.private} == HEAD | {k for k in model.state_dict() if k.endswith("num_batches_tracked")}
    assert [s.name for s in policy.download] == [s.name for s in policy.upload] == algo.shared_keys
    assert set(algo.shared_keys) == set(model.state_dict()) - {s.name for s in policy.private}
    assert algo.evaluates == ("personal",)


def test_two_personal_blocks_keep_the_last_conv_with_its_norm_statistics():
    algo, _ = make_algo("fedper", fedper_personal_layers=2)
    assert {"conv3.weight", "norm3.running_mean", "classifier.bias"} <= set(algo.private_keys)
    assert "conv2.weight" in algo.shared_keys and not any(k.startswith(("conv3", "norm3")) for k in algo.shared_keys)


def test_complement_of_lg_fedavg():
    fedper, _ = make_algo("fedper", fedper_personal_layers=2)
    lg, _ = make_algo("lg-fedavg", lg_global_layers=2)
    counters = {k for k in fedper.private_keys if k.endswith("num_batches_tracked")}
    assert set(fedper.private_keys) - counters == set(lg.shared_keys)


@pytest.mark.parametrize("k,problem", [(0, " must be >= 1, got 0"), (5, ": the model has 4 blocks")])
def test_bad_number_of_personal_layers(k, problem):
    with pytest.raises(MpiflError, match=f"--fedper-personal-layers{problem}"):
        make_algo("fedper", fedper_personal_layers=k)
