"""state_entries: one exact entry per state-dict key, kinds by owning module."""

import pytest
import torch
from torch import nn

from mpifl.models import NORM_KINDS, StateEntry, build_model, state_entries

CONV_NORM_KIND = {"jsbn": "bn", "bn": "bn", "gn": "gn", "ln": "ln", "in": "in", "perxan": "perxan", "agn": "agn",
                  "ibn": "ibn", "dson": "dson"}
# in, none, perxan, dson: Identity after linear layers
FC_NORM_KIND = {"jsbn": "bn", "bn": "bn", "gn": "gn", "ln": "ln", "agn": "agn", "ibn": "bn"}


@pytest.mark.parametrize("norm", NORM_KINDS)
def test_digitmodel_entries_match_state_dict(norm):
    model = build_model("digitmodel", num_classes=10, norm=norm)
    state = model.state_dict()
    entries = state_entries(model)
    assert [e.key for e in entries] == list(state)
    params = dict(model.named_parameters())
    for e in entries:
        assert e.shape == tuple(state[e.key].shape)
        assert e.dtype == state[e.key].dtype
        assert e.attr == e.key.rsplit(".", 1)[1]
        assert e.is_param == (e.key in params)
        owner = e.key.split(".")[0]
        if owner.startswith("conv"):
            expected = "conv"
        elif owner.startswith("fc"):
            expected = "linear"
        elif owner in ("bn1", "bn2", "bn3"):
            expected = CONV_NORM_KIND[norm]
        else:
            expected = FC_NORM_KIND[norm]
        assert e.module_kind == expected, e.key
        assert e.is_norm == owner.startswith("bn")
        if expected in ("perxan", "ibn"):
            side = "bn" if e.key.split(".")[1] in ("bn", "bn_score") else "in"
            assert (e.part, e.is_bn_side) == (side, side == "bn"), e.key
        elif expected == "dson":  # every entry domain-specific
            assert (e.part, e.is_bn_side) == ("bn", True), e.key
        else:
            assert (e.part, e.is_bn_side) == ("", False), e.key


def test_digitmodel_bn_flags_and_sizes():
    entries = {e.key: e for e in state_entries(build_model("digitmodel", num_classes=10))}
    stats = sorted(k for k, e in entries.items() if e.is_bn_stat)
    attrs = ("running_mean", "running_var", "num_batches_tracked")
    assert stats == sorted(f"bn{i}.{a}" for i in range(1, 6) for a in attrs)
    assert not entries["bn1.weight"].is_bn_stat and entries["bn1.weight"].is_param
    assert not entries["bn4.running_var"].is_param
    counter = entries["bn3.num_batches_tracked"]
    assert (counter.shape, counter.dtype, counter.numel, counter.nbytes) == ((), torch.int64, 1, 8)
    fc1 = entries["fc1.weight"]
    assert (fc1.shape, fc1.numel, fc1.nbytes) == ((2048, 6272), 2048 * 6272, 4 * 2048 * 6272)
    assert sum(e.nbytes for e in entries.values() if e.is_param) == 4 * 14_219_210


def test_gn_instance_norm_stats_are_not_bn_stats():
    entries = state_entries(build_model("smallcnn", num_classes=10, norm="gn"))
    assert not any(e.is_bn_stat for e in entries)
    assert [e.key for e in entries if e.is_norm] == [
        f"norm{i}.{a}" for i in (1, 2, 3) for a in ("weight", "bias")
    ]


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("step", torch.zeros((), dtype=torch.int32))
        self.ln = nn.LayerNorm(4)
        self.gn1 = nn.GroupNorm(1, 4)
        self.gn2 = nn.GroupNorm(2, 4)
        self.bn3d = nn.BatchNorm3d(2, track_running_stats=False)
        self.inorm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
        self.conv = nn.ConvTranspose2d(2, 2, 3)
        self.emb = nn.Embedding(5, 2)
        self.block = nn.Sequential(nn.Linear(2, 2))
        self.shared = self.block  # registered twice: both keys are in state_dict


def test_module_kinds_of_every_module_type():
    model = Mixed()
    entries = state_entries(model)
    assert [e.key for e in entries] == list(model.state_dict())
    kinds = {e.key: e.module_kind for e in entries}
    assert kinds == {
        "scale": "other",
        "step": "other",
        "ln.weight": "ln",
        "ln.bias": "ln",
        "gn1.weight": "ln",
        "gn1.bias": "ln",
        "gn2.weight": "gn",
        "gn2.bias": "gn",
        "bn3d.weight": "bn",
        "bn3d.bias": "bn",
        "inorm.weight": "in",
        "inorm.bias": "in",
        "inorm.running_mean": "in",
        "inorm.running_var": "in",
        "inorm.num_batches_tracked": "in",
        "conv.weight": "conv",
        "conv.bias": "conv",
        "emb.weight": "other",
        "block.0.weight": "linear",
        "block.0.bias": "linear",
        "shared.0.weight": "linear",
        "shared.0.bias": "linear",
    }
    by_key = {e.key: e for e in entries}
    assert by_key["scale"].is_param and by_key["scale"].attr == "scale"
    assert not by_key["step"].is_param and by_key["step"].nbytes == 4
    assert not by_key["inorm.running_mean"].is_bn_stat
    assert by_key["inorm.running_mean"].is_norm
    assert by_key["shared.0.weight"].is_param


def test_entries_are_frozen():
    entry = state_entries(nn.Linear(2, 3))[0]
    assert entry == StateEntry("weight", "linear", "weight", True, (3, 2), torch.float32)
    with pytest.raises(AttributeError):
        entry.key = "other"


def test_perxan_sides_and_bn_stats():
    entries = state_entries(build_model("smallcnn", num_classes=10, norm="perxan"))
    bn_side = [e.key for e in entries if e.is_bn_side]
    in_side = [e.key for e in entries if e.part == "in"]
    layer_bn = ["bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
                "bn.num_batches_tracked", "bn_score"]  # fmt: skip
    assert sorted(bn_side) == sorted(f"norm{i}.{k}" for i in (1, 2, 3) for k in layer_bn)
    assert sorted(in_side) == sorted(
        f"norm{i}.{k}" for i in (1, 2, 3) for k in ("inorm.weight", "inorm.bias", "in_score")
    )
    by_key = {e.key: e for e in entries}
    assert by_key["norm1.bn_score"].is_param and by_key["norm1.bn_score"].attr == "bn_score"
    assert by_key["norm2.bn.running_var"].is_bn_stat and not by_key["norm2.bn.weight"].is_bn_stat
    assert all(e.is_norm for e in entries if e.part)
    assert {e.module_kind for e in entries if e.key.startswith("conv")} == {"conv"}


def test_new_module_kinds():
    model = build_model("smallcnn", num_classes=10, norm="agn", conv="ws")
    by_key = {e.key: e for e in state_entries(model)}
    assert by_key["conv1.gain"].module_kind == "conv" and by_key["conv1.gain"].is_param
    agn = {k: e for k, e in by_key.items() if k.startswith("norm1.")}
    assert {e.module_kind for e in agn.values()} == {"agn"}
    assert sorted(e.attr for e in agn.values()) == sorted(
        ["weight", "bias", "select_logits", "running_mean", "running_var", "choice"]
    )
    assert not any(e.is_bn_stat for e in agn.values())
    assert all(e.is_norm for e in agn.values())
    assert by_key["norm1.choice"].dtype == torch.int64 and not by_key["norm1.choice"].is_param
    wn = {e.key: e for e in state_entries(build_model("smallcnn", num_classes=10, conv="wn"))}
    assert wn["conv2.weight"].module_kind == "conv"
