"""Global average pooling that stays deterministic on a GPU.

``F.adaptive_avg_pool2d(x, 1)`` has no deterministic CUDA backward (it adds with atomics), so under
``torch.use_deterministic_algorithms`` (``--deterministic``) it raises.  The mean over H and W is the same
pooling with a deterministic backward; it is used only then, so every other run computes as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def global_avg_pool(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, C, 1, 1), the mean over H and W."""
    if x.is_cuda and torch.are_deterministic_algorithms_enabled():
        return x.mean((2, 3), keepdim=True)
    return F.adaptive_avg_pool2d(x, 1)
