"""ELCFS's boundary-oriented episodic loss (Liu, Chen, Qin, Dou & Heng, CVPR 2021, sec. 3.4), on a
segmentation task, as the authors' code computes it (``liuquande/FedDG-ELCFS``: ``train_ELCFS.py``,
``dataloaders/fundus_dataloader.py``).

For each foreground class c of the masks:

* **regions** of each image: its contour ``R_c - erode(R_c)`` (one erosion) and the background band
  around it ``dilate(R_c, 5) - R_c`` (five dilations), both with the cross (4-neighbour) structuring
  element and the outside of the image counted as background (``scipy.ndimage`` defaults);
* **embeddings**: the mean of the features (the last decoder map, ``model.encode``, at the input size) over
  each region, of the meta-train images (theta) and of their interpolated copies (theta'): 2N contour and
  2N background embeddings;
* **NT-Xent** with those labels (contour 1, background 0; ``pytorch_metric_learning``'s ``NTXentLoss`` the
  code calls), cosine similarities s, temperature tau (0.05)::

      l(a, p) = -log( exp(s_ap / tau) / (exp(s_ap / tau) + sum_{n: label n != label a} exp(s_an / tau)) )

  averaged over every ordered pair (a, p), a != p, of equal labels.

The losses of the classes are summed; the code weighs the sum by 0.1 in the meta-test objective.  An image
whose contour or band is empty (no foreground of that class) is left out of that class's term (the code
divides by the region's size and would give NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DILATIONS = 5  # the code's binary_dilation(iterations=5)


def _neighbours(mask: torch.Tensor, fill: bool) -> list[torch.Tensor]:
    """The 4 shifted copies of (N, H, W) bool ``mask``, ``fill`` outside the image."""
    padded = F.pad(mask.float(), (1, 1, 1, 1), value=float(fill)).bool()
    return [padded[:, :-2, 1:-1], padded[:, 2:, 1:-1], padded[:, 1:-1, :-2], padded[:, 1:-1, 2:]]


def erode(mask: torch.Tensor) -> torch.Tensor:
    """One binary erosion with the cross, the outside counting as background."""
    out = mask.clone()
    for shifted in _neighbours(mask, False):
        out &= shifted
    return out


def dilate(mask: torch.Tensor, times: int = 1) -> torch.Tensor:
    """``times`` binary dilations with the cross."""
    for _ in range(times):
        grown = mask.clone()
        for shifted in _neighbours(mask, False):
            grown |= shifted
        mask = grown
    return mask


def regions(masks: torch.Tensor, label: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(contour, background band) of class ``label`` in (N, H, W) masks, bool."""
    region = masks == label
    return region & ~erode(region), dilate(region, DILATIONS) & ~region


def region_means(features: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
    """(N, F): the mean of (N, F, H, W) ``features`` over each image's (N, H, W) ``region``."""
    weights = region.unsqueeze(1).to(features.dtype)
    return (features * weights).sum((2, 3)) / weights.sum((2, 3))


def nt_xent(embeddings: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """NT-Xent over (M, F) ``embeddings`` with (M,) ``labels`` (module docstring)."""
    unit = F.normalize(embeddings, dim=1)
    logits = unit @ unit.T / temperature
    same = labels[:, None] == labels[None, :]
    positive = same & ~torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    negatives = torch.where(~same, logits.exp(), torch.zeros_like(logits)).sum(1, keepdim=True)
    per_pair = -logits + torch.log(logits.exp() + negatives)
    return per_pair[positive].mean()


def boundary_loss(inner: torch.Tensor, outer: torch.Tensor, masks: torch.Tensor, classes: int,
                  temperature: float) -> torch.Tensor:
    """Sum over foreground classes of the NT-Xent of contour against band embeddings of the meta-train
    (``inner``) and meta-test (``outer``) features, (N, F, H, W) each."""
    total = inner.new_zeros(())
    for label in range(1, classes):
        contour, band = regions(masks, label)
        keep = (contour.flatten(1).any(1) & band.flatten(1).any(1))
        if not keep.any():
            continue
        contour, band = contour[keep], band[keep]
        embeddings = torch.cat([region_means(inner[keep], contour), region_means(outer[keep], contour),
                                region_means(inner[keep], band), region_means(outer[keep], band)])
        count = 2 * int(keep.sum())  # contours (label 1), then bands (label 0), of both passes
        labels = torch.cat([torch.ones(count), torch.zeros(count)]).to(masks.device)
        total = total + nt_xent(embeddings, labels, temperature)
    return total
