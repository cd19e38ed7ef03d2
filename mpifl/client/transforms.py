"""``--train-transforms flip,rotate,rot90-flip,crop,jitter,jitter-hue``: training augmentations done in batch on the
device.

Each acts on a whole mini-batch of float pixels in [0, 255] (N, C, H, W),
before normalization, with per-image random parameters drawn from the
client's seeded generator of the round (so they are the same whatever rank
trains the client), and no per-image Python work:

* ``flip``: horizontal flip with probability 1/2 (torchvision's
  ``RandomHorizontalFlip``);
* ``rotate``: rotation about the centre by an angle uniform in [-30, 30]
  degrees, nearest pixel, zero fill outside the image (FedBN's public code,
  ``RandomRotation((-30, 30))``, which FedWon follows on Office-Caltech-10
  and DomainNet; positive angles counter-clockwise, as torchvision);
* ``rot90-flip``: the prostate MRI loaders of HarmoFL's code (Jiang, Wang & Dou, AAAI 2022:
  ``utils/dataset.py``) and FedFA's code (Zhou & Konukoglu, ICLR 2023: ``pyfed/dataset/dataset.py``), which
  agree: every image is first turned counter-clockwise by k x 90 degrees (``RandomRotate90``: p 1,
  ``np.rot90(img, random.randint(0, 4))`` on the H x W x C slice, k uniform in 0..4 inclusive, so no turn
  with probability 2/5), then with probability 3/4 flipped (``RandomFlip``: p 0.75, ``cv2.flip(img, d)``,
  d uniform in -1, 0, 1): d = 0 reverses the rows (top-bottom), d = 1 the columns (left-right), d = -1 both
  (a half turn).  The "one of three axes" are these three flip codes of the slice's two image axes; the
  channel axis (the slice and its two neighbours) is never flipped.  Needs square images (the prostate
  slices are 384 x 384);
* ``crop``: pad each side by ``max(1, round(size / 8))`` pixels (4 at 32 px,
  torchvision's ``RandomCrop(32, padding=4)`` of CIFAR training), reflecting
  the border, and cut a random window of the original size;
* ``jitter``: brightness, contrast and saturation factors each uniform in
  [0.6, 1.4] (``ColorJitter(0.4, 0.4, 0.4)``), applied in that fixed order
  (torchvision shuffles the order per call; a fixed one keeps the batch one
  computation), clamped to [0, 255]; single-channel images skip saturation;
* ``jitter-hue``: gPerXAN's public code (albumentations' ``ColorJitter()``
  defaults): each image with probability 1/2 gets brightness, contrast and
  saturation factors uniform in [0.8, 1.2] and then a hue shift uniform in
  [-0.2, 0.2] of the colour circle (HSV hue; single-channel images skip
  saturation and hue), in that fixed order, clamped to [0, 255].

A segmentation batch's masks (N, H, W) move with their images: ``flip``,
``rotate``, ``rot90-flip`` and ``crop`` are geometric and apply each image's drawn flip,
angle or window to its mask too, by nearest pixel, so labels stay in the
label set; what the image fills, the mask fills alike (``rotate``: 0,
background; ``crop``: the reflected mask).  ``jitter`` and ``jitter-hue`` are
photometric and leave masks alone.  Each transform first draws its
parameters for the batch, then returns the operation that applies them
(:data:`Warp`), so a mask costs no extra draw and a batch without one sees
the same draws and numbers.

Evaluation never transforms.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

from ..errors import MpiflError
from ..plan.config import TRANSFORMS

JITTER = 0.4
ROTATE_DEGREES = 30.0
JITTER_HUE = (0.5, 0.2, 0.2)  # jitter-hue: probability, brightness/contrast/saturation strength, hue shift
ROT90_TURNS, ROT90_FLIP = 5, 0.75  # rot90-flip: k drawn in 0..4 (HarmoFL/FedFA randint(0, 4)), flip probability
GRAY = (0.299, 0.587, 0.114)  # ITU-R 601 luma weights, as torchvision's rgb_to_grayscale


Warp = Callable[[torch.Tensor], torch.Tensor]  # drawn parameters applied to a float (N, C, H, W) tensor


def _flip(x: torch.Tensor, rng: np.random.Generator) -> Warp:
    flipped = torch.as_tensor(rng.random(len(x)) < 0.5, device=x.device)
    return lambda t: torch.where(flipped[:, None, None, None], t.flip(-1), t)


def _rotate(x: torch.Tensor, rng: np.random.Generator) -> Warp:
    angles = np.deg2rad(rng.uniform(-ROTATE_DEGREES, ROTATE_DEGREES, size=len(x)))
    cos, sin = (torch.as_tensor(f(angles), dtype=x.dtype, device=x.device) for f in (np.cos, np.sin))
    n, _, h, w = x.shape
    # output pixel (u, v) in normalized coords samples the input at the inverse rotation; y points down,
    # so a counter-clockwise turn on screen maps (u, v) -> (u cos - v sin h/w, u sin w/h + v cos)
    theta = torch.zeros(n, 2, 3, dtype=x.dtype, device=x.device)
    theta[:, 0, 0], theta[:, 0, 1] = cos, -sin * h / w
    theta[:, 1, 0], theta[:, 1, 1] = sin * w / h, cos
    grid = torch.nn.functional.affine_grid(theta, list(x.shape), align_corners=False)
    return lambda t: torch.nn.functional.grid_sample(t, grid, mode="nearest", padding_mode="zeros",
                                                     align_corners=False)


def _rot90_flip(x: torch.Tensor, rng: np.random.Generator) -> Warp:
    n, _, h, w = x.shape
    if h != w:
        raise MpiflError(f"--train-transforms rot90-flip turns images by 90 degrees and needs square ones, got "
                         f"{h} x {w}; pick flip or rotate")
    turns = torch.as_tensor(rng.integers(0, ROT90_TURNS, size=n) % 4, device=x.device)[:, None, None, None]
    flipped = rng.random(n) < ROT90_FLIP
    code = rng.integers(-1, 2, size=n)  # cv2.flip: 0 rows, 1 columns, -1 both
    rows = torch.as_tensor(flipped & (code <= 0), device=x.device)[:, None, None, None]
    cols = torch.as_tensor(flipped & (code != 0), device=x.device)[:, None, None, None]

    def warp(t: torch.Tensor) -> torch.Tensor:
        out = t
        for k in (1, 2, 3):
            out = torch.where(turns == k, torch.rot90(t, k, dims=(-2, -1)), out)
        out = torch.where(rows, out.flip(-2), out)
        return torch.where(cols, out.flip(-1), out)
    return warp


def _crop(x: torch.Tensor, rng: np.random.Generator) -> Warp:
    n, _, h, w = x.shape
    pad = max(1, round(min(h, w) / 8))
    dy = torch.as_tensor(rng.integers(0, 2 * pad + 1, size=n), device=x.device)
    dx = torch.as_tensor(rng.integers(0, 2 * pad + 1, size=n), device=x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # (N, H, 1)
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]  # (N, 1, W)

    def warp(t: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(t, (pad, pad, pad, pad), mode="reflect")
        picked = padded[torch.arange(n, device=t.device)[:, None, None], :, rows, cols]  # (N, H, W, C)
        return picked.permute(0, 3, 1, 2).contiguous()
    return warp


def _gray(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] != 3:
        return x.mean(dim=1, keepdim=True)
    weights = torch.tensor(GRAY, dtype=x.dtype, device=x.device)
    return (x * weights[None, :, None, None]).sum(dim=1, keepdim=True)


def _color(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Brightness, contrast, then (RGB only) saturation, by per-image factors (3, N, 1, 1, 1)."""
    brightness, contrast, saturation = factors
    x = (x * brightness).clamp(0, 255)
    mean = _gray(x).mean(dim=(1, 2, 3), keepdim=True)
    x = ((x - mean) * contrast + mean).clamp(0, 255)
    if x.shape[1] == 3:
        gray = _gray(x)
        x = ((x - gray) * saturation + gray).clamp(0, 255)
    return x


def _jitter(x: torch.Tensor, rng: np.random.Generator) -> Warp:
    factors = torch.as_tensor(rng.uniform(1 - JITTER, 1 + JITTER, size=(3, len(x))), dtype=x.dtype,
                              device=x.device)[:, :, None, None, None]
    return lambda t: _color(t, factors)


def _hue_shift(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """RGB in [0, 255] (N, 3, H, W) with each image's HSV hue moved by ``shift`` (N,) turns."""
    rgb = x / 255
    value, _ = rgb.max(dim=1)
    delta = value - rgb.min(dim=1).values
    sat = torch.where(value > 0, delta / value.clamp_min(1e-12), torch.zeros_like(value))
    r, g, b = rgb.unbind(1)
    safe = delta.clamp_min(1e-12)
    hue = torch.where(value == r, ((g - b) / safe) % 6, torch.where(value == g, (b - r) / safe + 2, (r - g) / safe + 4))
    hue = torch.where(delta > 0, hue, torch.zeros_like(hue)) + 6 * shift[:, None, None]
    # hsv -> rgb: channel n in (5, 3, 1) is v - v s clamp(min(k, 4 - k), 0, 1) with k = (n + 6h) mod 6
    out = [value - value * sat * torch.minimum((n + hue) % 6, 4 - (n + hue) % 6).clamp(0, 1) for n in (5, 3, 1)]
    return torch.stack(out, dim=1) * 255


def _jitter_hue(x: torch.Tensor, rng: np.random.Generator) -> Warp:
    p, strength, hue = JITTER_HUE
    n = len(x)
    picked = torch.as_tensor(rng.random(n) < p, device=x.device)
    factors = torch.as_tensor(rng.uniform(1 - strength, 1 + strength, size=(3, n)), dtype=x.dtype,
                              device=x.device)[:, :, None, None, None]
    shifts = torch.as_tensor(rng.uniform(-hue, hue, size=n), dtype=x.dtype, device=x.device)

    def warp(t: torch.Tensor) -> torch.Tensor:
        out = _color(t, factors)
        if t.shape[1] == 3:
            out = _hue_shift(out, shifts).clamp(0, 255)
        return torch.where(picked[:, None, None, None], out, t)
    return warp


class Transform(NamedTuple):
    """``draw(x, rng)`` draws the batch's parameters and returns the :data:`Warp` applying them; a geometric
    one's warp also moves the masks."""
    draw: Callable[[torch.Tensor, np.random.Generator], Warp]
    geometric: bool


_BY_NAME: dict[str, Transform] = {
    "flip": Transform(_flip, True), "rotate": Transform(_rotate, True),
    "rot90-flip": Transform(_rot90_flip, True), "crop": Transform(_crop, True),
    "jitter": Transform(_jitter, False), "jitter-hue": Transform(_jitter_hue, False)}


def flip(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    return _flip(x, rng)(x)


def rotate(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    return _rotate(x, rng)(x)


def rot90_flip(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    return _rot90_flip(x, rng)(x)


def crop(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    return _crop(x, rng)(x)


def jitter(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    return _jitter(x, rng)(x)


def jitter_hue(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    return _jitter_hue(x, rng)(x)


class TrainTransforms:
    """The chosen transforms, applied in the order of :data:`TRANSFORMS` (FedBN: flip, then rotate)."""

    def __init__(self, names: tuple[str, ...]):
        unknown = [n for n in names if n not in _BY_NAME]
        if unknown:
            raise ValueError(f"unknown transform {unknown[0]}")
        self.steps = [_BY_NAME[n] for n in TRANSFORMS if n in names]

    def __bool__(self) -> bool:
        return bool(self.steps)

    def __call__(self, x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        return self.with_masks(x, None, rng)[0]

    def with_masks(self, x: torch.Tensor, masks: torch.Tensor | None,
                   rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Images (N, C, H, W) float and their integer masks (N, H, W), or None, transformed alike: the
        geometric steps apply each image's draw to its mask, nearest pixel, in the image's dtype and back (exact
        for labels below 2^24 in float32); masks keep their dtype."""
        moved = None if masks is None else masks.to(x.dtype)[:, None]
        for step in self.steps:
            warp = step.draw(x, rng)
            x = warp(x)
            if step.geometric and moved is not None:
                moved = warp(moved)
        return x, None if masks is None else moved[:, 0].to(masks.dtype)
