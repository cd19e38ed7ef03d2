"""Checks every model must pass, shared by the per-architecture tests."""

import torch
from torch import nn

FIXED_SIZE = {"lenet": (32, 32), "digitmodel": (28, 28), "fedwon-cnn": (28, 28)}  # the rest take any size


def input_size(name: str) -> tuple[int, int]:
    """An input size model ``name`` accepts: its fixed one, else 64x64."""
    return FIXED_SIZE.get(name, (64, 64))


def assert_trains_and_follows_the_protocol(model: nn.Module, x: torch.Tensor, feature_dim: int) -> None:
    """One backward pass gives finite gradients; in eval, ``encode`` is (B, D) and
    ``forward == classifier(encode(x))`` exactly."""
    model.train()
    y = torch.randint(0, model.classifier.out_features, (len(x),))
    nn.functional.cross_entropy(model(x), y).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    with torch.no_grad():
        assert model.encode(x).shape == (len(x), feature_dim)
        assert torch.equal(model(x), model.classifier(model.encode(x)))
