"""Builder-side checks shared by the registry's models: kinds and image sizes.

Every builder validates ``norm`` and ``conv`` first (so an unknown kind is
reported as such, whatever the image size), then the image size.

Image sizes: a model states the smallest input its layers can take, as a
function ``final_map(side) -> side`` giving the side of its *smallest*
normalized feature map for an input of that side (0 when the input is too
small for one of its pooling layers).  The rule is

* the smallest map must be at least 1 x 1, and at least 2 x 2 with ``in`` or
  ``perxan``: InstanceNorm in training needs more than one spatial element;
* the input must also be at least the model's ``floor`` (e.g. 32 for the
  ImageNet-style networks, whose stem alone divides the side by 4).

:func:`min_image_size` computes the exact least side;
:func:`check_image_size` raises :class:`~mpifl.errors.MpiflError` naming the
model, the least size and the ``prepare --size`` fix.
"""

from __future__ import annotations

from typing import Callable

from mpifl.errors import MpiflError
from mpifl.models.norm import CONV_KINDS, supports_vectors

#: Norm kinds with per-instance spatial statistics in training (need >= 2x2 maps).
INSTANCE_NORMS = frozenset({"in", "perxan", "ibn", "dson"})
_SEARCH_LIMIT = 4096


def check_kinds(norm: str, conv: str) -> None:
    """Raise :class:`MpiflError` for an unknown ``norm`` or ``conv`` kind."""
    supports_vectors(norm)  # raises "unknown norm ..." for unknown kinds
    if conv not in CONV_KINDS:
        raise MpiflError(f"unknown conv {conv!r}; choose one of: {', '.join(CONV_KINDS)}")


def ceil_half(side: int) -> int:
    """Side after a stride-2 layer that rounds up (3x3 pad 1, 7x7 pad 3, 1x1, 3/2 pad-1 pool)."""
    return (side - 1) // 2 + 1


def min_image_size(final_map: Callable[[int], int], norm: str, floor: int = 1) -> int:
    """Least side ``s >= floor`` with ``final_map(s) >= 2`` (``in``/``perxan``), else ``>= 1``."""
    need = 2 if norm in INSTANCE_NORMS else 1
    for side in range(max(floor, 1), _SEARCH_LIMIT + 1):
        if final_map(side) >= need:
            return side
    raise ValueError("no input side up to 4096 satisfies the model's size rule")


def check_image_size(
    model: str,
    image_size: tuple[int, int],
    norm: str,
    *,
    final_map: Callable[[int], int],
    floor: int = 1,
    paper_size: int | None = None,
    smaller: str = "resnet20 or smallcnn",
) -> None:
    """Raise :class:`MpiflError` when ``image_size`` is below the model's least side.

    The message names the model, the least size, the ``prepare --size`` fix and
    ``smaller``, the models that take smaller images.
    """
    least = min_image_size(final_map, norm, floor)
    h, w = image_size
    if min(h, w) >= least:
        return
    because = ""
    if norm in INSTANCE_NORMS and least > min_image_size(final_map, "bn", floor):
        because = f" with norm {norm!r} (instance statistics need 2x2 maps in the last stage)"
    target = max(least, paper_size or least)
    raise MpiflError(
        f"model {model} needs images of at least {least}x{least}{because} but the data is "
        f"{h}x{w}; prepare the dataset larger (python -m mpifl.data prepare NAME --size {target}) "
        f"or use a model for smaller images ({smaller})"
    )
