import numpy as np
import pytest
import torch

from mpifl.algorithms import ALGORITHMS, Uploads, get_algorithm
from mpifl.errors import MpiflError
from mpifl.plan.config import RunConfig
from mpifl.plan.task import CLASSIFICATION, SEGMENTATION

from ..helpers import aggregate, client_meta, gradients_after_shift, make_algo


_algo = make_algo


def test_fedavg_policy_shares_everything_but_num_batches_tracked():
    algo, model = _algo("fedavg")
    policy = algo.policy()
    names = {s.name for s in policy.download}
    assert names == {s.name for s in policy.upload}
    assert names == {k for k in model.state_dict() if not k.endswith("num_batches_tracked")}
    assert {s.name for s in policy.private} == {k for k in model.state_dict() if k.endswith("num_batches_tracked")}


def test_singleset_shares_nothing():
    algo, model = _algo("singleset")
    policy = algo.policy()
    assert policy.download == [] and policy.upload == []
    assert len(policy.private) == len(model.state_dict())
    assert algo.evaluates == ("personal",)


def _uploads(values, samples):
    return Uploads(clients=np.arange(len(samples)),
                   meta=client_meta(samples),
                   tensors=values)


def test_fedavg_aggregates_by_samples_or_uniformly():
    for uniform, expected in ((False, 0.25 * 1 + 0.75 * 5), (True, 3.0)):
        algo, model = _algo("fedavg", uniform_weights=uniform)
        server = algo.init_server(model.state_dict())
        uploads = {k: [np.full(v.shape, 1.0, np.float32), np.full(v.shape, 5.0, np.float32)]
                   for k, v in server.model.items()}
        aggregate(algo, server, _uploads(uploads, [10, 30]))
        for tensor in server.model.values():
            assert tensor.dtype == torch.float32
            assert torch.allclose(tensor, torch.full_like(tensor, expected))


def test_fedprox_gradient_is_mu_times_distance_to_global():
    algo, model = _algo("fedprox", mu=0.5)
    for grad in gradients_after_shift(algo, model):
        assert torch.allclose(grad, torch.full_like(grad, 0.5))


def test_registry_and_unknown_name():
    assert {"fedavg", "fedprox", "singleset"} <= set(ALGORITHMS)
    with pytest.raises(MpiflError, match="unknown algorithm 'fedsgd'.*fedavg"):
        get_algorithm("fedsgd")


def test_keep_optimizer_is_refused_where_the_rule_assumes_a_fresh_optimizer():
    fresh = sorted(name for name in ALGORITHMS if get_algorithm(name).fresh_optimizer)
    assert fresh == ["feddc", "fednova", "scaffold"]
    kept = {"keep_optimizer": True, "momentum": 0.9}
    for name in fresh:
        with pytest.raises(MpiflError, match="--keep-optimizer: .*a_K.*drop --keep-optimizer"):
            make_algo(name, kept)
        make_algo(name, {"momentum": 0.9})
    make_algo("fedavg", kept)


def test_a_rule_option_takes_only_its_choices_in_one_line():
    with_choices = [(name, o) for name, cls in ALGORITHMS.items() for o in cls.options if o.choices]
    assert len(with_choices) >= 16 and all(o.default in o.choices for _, o in with_choices)
    for name, option in with_choices:
        with pytest.raises(MpiflError, match=rf"^{option.flag} must be one of {', '.join(option.choices)}, "
                                             r"got 'nope'$"):
            make_algo(name, **{option.name: "nope"})
    cls = get_algorithm("fednn")  # refused before the model is built and adapted
    cfg = RunConfig(algo="fednn", algo_options={o.name: o.default for o in cls.options} | {"agn_mix": "sd"})
    with pytest.raises(MpiflError, match="^--agn-mix must be one of var, std, got 'sd'$"):
        cls.network(cfg, num_classes=10)


def test_methods_whose_rule_needs_classes_refuse_a_segmentation_task_in_one_line():
    refusing = sorted(name for name, cls in ALGORITHMS.items() if cls.classification_only)
    assert refusing == ["copa", "fedbabu", "fedmix", "fedper", "fedproto", "fedrep", "lg-fedavg", "rsc"]
    algo, _ = make_algo("fedproto")
    with pytest.raises(MpiflError, match=r"^--algo fedproto averages class prototypes, .*; styledigits is a "
                                         r"segmentation dataset \(a class per pixel\): pick a method"):
        algo.bind_task(SEGMENTATION)
    algo.bind_task(CLASSIFICATION)
    fedbn, _ = make_algo("fedbn")
    fedbn.bind_task(SEGMENTATION)
    assert fedbn.task is SEGMENTATION


def test_a_runs_selection_resolves_auto_to_its_methods_rule():
    assert get_algorithm("gperxan").selection_for("auto") == "local-val"
    assert get_algorithm("fedavg").selection_for("auto") == "val-mean"
    assert get_algorithm("gperxan").selection_for("val-mean") == "val-mean"
