"""``--show-manifest``'s text: every wire tensor, with what is computed from the clients' data marked."""

import pytest
import torch

from mpifl.algorithms import get_algorithm
from mpifl.models import build_model, state_entries
from mpifl.plan.config import RunConfig
from mpifl.plan.normalize import stats_spec
from mpifl.transport.manifest import format_manifest
from mpifl.transport.share import SharePolicy
from mpifl.transport.wire import TensorSpec

from ..algorithms.helpers import make_algo
from ..conftest import run_here


def test_data_derived_tensors_are_marked_and_parameters_are_not():
    weight = TensorSpec("fc.weight", (4, 2), torch.float32)
    stats = TensorSpec("x.stats", (2, 3), torch.float32, derived="channel means", exposes="data statistics")
    text = format_manifest("demo", SharePolicy(download=[weight], upload=[weight, stats], private=[]), 2,
                           setup=[stats_spec(3)], training_clients=5)
    lines = text.splitlines()
    assert lines[1].endswith("(240 bytes); data-derived: per-channel mean and std of the client's training images")
    assert [l.endswith("data-derived: channel means") for l in lines if "x.stats" in l] == [True]
    assert all("data-derived" not in l for l in lines if "fc.weight" in l)
    assert stats == TensorSpec("x.stats", (2, 3), torch.float32)  # a label, not part of the spec's identity


def test_a_data_derived_tensor_names_what_it_exposes_and_a_model_tensor_does_not():
    with pytest.raises(TypeError, match="says what it exposes"):
        TensorSpec("x.stats", (2,), torch.float32, derived="channel means")
    with pytest.raises(TypeError, match="says what it exposes"):
        TensorSpec("fc.weight", (2,), torch.float32, exposes="prototypes")
    with pytest.raises(TypeError, match="says what it exposes"):
        TensorSpec("x.stats", (2,), torch.float32, derived="channel means", exposes="secrets")


def test_running_statistics_are_marked_in_every_policy_and_trained_parameters_never():
    algo, model = make_algo("fedavg")
    policy = algo.policy()
    marked = {s.name for s in policy.download if s.derived}
    entries = {e.key: e for e in state_entries(model)}
    assert marked == {k for k, e in entries.items() if e.attr in ("running_mean", "running_var")} and marked
    assert not any(entries[s.name].is_param for s in policy.upload if s.derived)


def test_method_tensors_of_client_data_are_marked():
    proto, _ = make_algo("fedproto")
    assert all(s.derived for s in proto.policy().upload + proto.policy().download)
    cls = get_algorithm("fedfa")
    cfg = RunConfig(algo="fedfa", algo_options={o.name: o.default for o in cls.options})
    fedfa = cls(cfg, state_entries(cls.adapt_model(build_model("smallcnn", num_classes=10), cfg)))
    down = {s.name: s.derived for s in fedfa.policy().download}
    assert down["fedfa.0.shared_var_mean"] == "variance over clients of their feature statistics"
    assert down["fedfa.running/0"] and all(s.derived for s in fedfa.extra_upload())
    assert not down["conv1.weight"]


@pytest.mark.slow
def test_fedmix_mean_images_are_marked_in_the_printed_manifest(data_root):
    job = run_here("--data-root", str(data_root), "--algo", "fedmix", "--show-manifest")
    assert job.returncode == 0, job.stderr
    setup = [l for l in job.stdout.splitlines() if l.startswith("setup exchange")]
    assert len(setup) == 1 and setup[0].endswith("data-derived: mean images of the client's training images and "
                                                 "their mean labels")


def test_gathered_uploads_are_marked_and_counted():
    weight = TensorSpec("fc.weight", (4, 2), torch.float32)
    stats = TensorSpec("x.stats", (2, 3), torch.float32)
    text = format_manifest("demo", SharePolicy(download=[weight], upload=[weight, stats], private=[],
                                               gathered=("x.stats",)), 2)
    upload = text.split("upload (client -> server)")[1].splitlines()
    assert [l.split()[0] for l in upload if l.endswith("gathered")] == ["x.stats"]
    assert "gathered whole by rank 0 (the rest is folded into sums as it arrives): 1 tensors, 24 bytes" in text
    stein, _ = make_algo("fedstein")
    assert set(stein.policy().gathered) == {s.name for s in stein.policy().upload if "running" in s.name}
