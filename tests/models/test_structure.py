"""Every registry model's blocks in forward order and its head, as share policies read them."""

import pytest
import torch

from mpifl.algorithms import get_algorithm
from mpifl.errors import MpiflError
from mpifl.models import MODEL_NAMES, build_model, state_entries
from mpifl.models.structure import blocks, last_blocks
from mpifl.plan.config import RunConfig

from .helpers import input_size



def _build(name, norm="bn"):
    return build_model(name, num_classes=5, image_size=input_size(name), norm=norm)


def _called_order(model, size):
    """Module names in the order a forward pass first calls them."""
    order, names = [], {m: n for n, m in model.named_modules()}
    hooks = [m.register_forward_pre_hook(lambda m, _: order.append(names[m]) if names[m] not in order else None)
             for m in model.modules()]
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, *size))
    for hook in hooks:
        hook.remove()
    return order


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("norm", ["bn", "perxan"])
def test_every_entry_has_a_block_the_blocks_run_in_forward_order_and_the_head_is_the_classifier(name, norm):
    model = _build(name, norm)
    entries = state_entries(model)
    head = next(n for n, m in model.named_modules() if m is model.classifier)
    assert {e.key for e in entries if e.is_head} == {f"{head}.weight", f"{head}.bias"}
    assert all(e.depth >= 0 for e in entries)
    assert {e.depth for e in entries if e.is_head} == {max(e.depth for e in entries)}
    called = _called_order(model, input_size(name))
    first_call = [min(called.index(m) for m in group if m in called) for group in blocks(model)]
    assert first_call == sorted(first_call), [g[0] for g in blocks(model)]
    assert last_blocks(entries, 1, "--n") == {head}


def test_lenet_registers_norms_after_its_classifier_but_they_belong_to_their_convs():
    entries = {e.key: e for e in state_entries(_build("lenet"))}
    assert entries["bn1.weight"].block == "conv1" and entries["bn2.running_mean"].block == "conv2"
    assert entries["fc3.weight"].depth == 4 and not entries["bn2.weight"].is_head


def test_inserted_layers_belong_to_the_block_they_follow():
    cls = get_algorithm("fedfa")
    cfg = RunConfig(algo="fedfa", algo_options={o.name: o.default for o in cls.options})
    model = cls.adapt_model(build_model("resnet18", num_classes=5, image_size=(64, 64)), cfg)
    inserted = [e for e in state_entries(model) if not e.key.startswith(("conv1", "bn1", "layer", "fc"))]
    assert inserted and {e.block for e in inserted} <= {"layer1", "layer2", "layer3", "layer4"}


def test_a_model_outside_the_registry_has_its_children_as_blocks():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.classifier = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)

    assert [(e.key, e.block, e.is_head) for e in state_entries(Net())] == [
        ("body.weight", "body", False), ("body.bias", "body", False),
        ("classifier.weight", "classifier", True), ("classifier.bias", "classifier", True)]
    with pytest.raises(MpiflError, match="--layers: the model has 2 blocks, asked for the last 3"):
        last_blocks(state_entries(Net()), 3, "--layers")
