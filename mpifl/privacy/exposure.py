"""What each tensor on the wire exposes of a client, and whether the run's privacy mechanism covers it, for
``--show-manifest`` (docs/privacy.md's per-method table is made from the same marks)."""

from __future__ import annotations

from ..transport.wire import TensorSpec
from .mechanism import Privacy


def exposes(spec: TensorSpec, direction: str) -> str:
    """The tensor's kind: its own label (data statistics, images or spectra, prototypes, scores), else model
    weights going down and a model update going up (a one-time exchange is always data-derived)."""
    return spec.exposes or ("model weights" if direction == "down" else "a model update")


def marks(privacy: Privacy):
    """``marks(spec, direction)`` for :func:`~mpifl.transport.manifest.format_manifest`: "<kind>; <coverage>"."""
    def mark(spec: TensorSpec, direction: str) -> str:
        return f"{exposes(spec, direction)}; {privacy.covers(spec, direction)}"
    return mark
