"""``--train-transforms flip,crop,jitter``: training augmentations done in batch on the device.

Each acts on a whole mini-batch of float pixels in [0, 255] (N, C, H, W),
before normalization, with per-image random parameters drawn from the
client's seeded generator of the round (so they are the same whatever rank
trains the client), and no per-image Python work:

* ``flip``: horizontal flip with probability 1/2 (torchvision's
  ``RandomHorizontalFlip``);
* ``crop``: pad each side by ``max(1, round(size / 8))`` pixels (4 at 32 px,
  torchvision's ``RandomCrop(32, padding=4)`` of CIFAR training), reflecting
  the border, and cut a random window of the original size;
* ``jitter``: brightness, contrast and saturation factors each uniform in
  [0.6, 1.4] (``ColorJitter(0.4, 0.4, 0.4)``), applied in that fixed order
  (torchvision shuffles the order per call; a fixed one keeps the batch one
  computation), clamped to [0, 255]; single-channel images skip saturation.

Evaluation never transforms.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

TRANSFORMS = ("flip", "crop", "jitter")
JITTER = 0.4
GRAY = (0.299, 0.587, 0.114)  # ITU-R 601 luma weights, as torchvision's rgb_to_grayscale


def parse(text: str) -> tuple[str, ...]:
    """``"flip,crop"`` -> ("flip", "crop"); "" or "none" -> ()."""
    names = tuple(t.strip() for t in text.split(",") if t.strip() and t.strip() != "none")
    return names


def flip(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    flipped = torch.as_tensor(rng.random(len(x)) < 0.5, device=x.device)
    return torch.where(flipped[:, None, None, None], x.flip(-1), x)


def crop(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    n, _, h, w = x.shape
    pad = max(1, round(min(h, w) / 8))
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad), mode="reflect")
    dy = torch.as_tensor(rng.integers(0, 2 * pad + 1, size=n), device=x.device)
    dx = torch.as_tensor(rng.integers(0, 2 * pad + 1, size=n), device=x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # (N, H, 1)
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]  # (N, 1, W)
    picked = padded[torch.arange(n, device=x.device)[:, None, None], :, rows, cols]  # (N, H, W, C)
    return picked.permute(0, 3, 1, 2).contiguous()


def _gray(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] != 3:
        return x.mean(dim=1, keepdim=True)
    weights = torch.tensor(GRAY, dtype=x.dtype, device=x.device)
    return (x * weights[None, :, None, None]).sum(dim=1, keepdim=True)


def jitter(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    factors = torch.as_tensor(rng.uniform(1 - JITTER, 1 + JITTER, size=(3, len(x))), dtype=x.dtype,
                              device=x.device)[:, :, None, None, None]
    brightness, contrast, saturation = factors
    x = (x * brightness).clamp(0, 255)
    mean = _gray(x).mean(dim=(1, 2, 3), keepdim=True)
    x = ((x - mean) * contrast + mean).clamp(0, 255)
    if x.shape[1] == 3:
        gray = _gray(x)
        x = ((x - gray) * saturation + gray).clamp(0, 255)
    return x


_BY_NAME: dict[str, Callable[[torch.Tensor, np.random.Generator], torch.Tensor]] = {
    "flip": flip, "crop": crop, "jitter": jitter}


class TrainTransforms:
    """The chosen transforms, applied in the order flip, crop, jitter."""

    def __init__(self, names: tuple[str, ...]):
        unknown = [n for n in names if n not in _BY_NAME]
        if unknown:
            raise ValueError(f"unknown transform {unknown[0]}")
        self.steps = [_BY_NAME[n] for n in TRANSFORMS if n in names]

    def __bool__(self) -> bool:
        return bool(self.steps)

    def __call__(self, x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        for step in self.steps:
            x = step(x, rng)
        return x
