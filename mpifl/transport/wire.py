"""Flat wire buffers: a fixed list of named tensors packed into one byte buffer.

Every exchange in mpifl moves one contiguous ``uint8`` buffer per direction
(docs/design.md, "How a round is computed"): no pickling, no per-tensor messages.  A :class:`WireLayout` is the
agreed order of the tensors in that buffer.  Both ends build the same layout
from the same specs, so only raw bytes travel.

Tensors are grouped by item size, largest first (float64, then float32/int32,
then float16, then uint8), so every tensor starts at an offset that is a
multiple of its own item size: views into the buffer are aligned.  A layout's
size is the sum of its tensors' bytes (the figure ``--show-manifest`` prints)
rounded up to a multiple of 8, so layouts placed back to back in one message
(an upload holds one per client) stay aligned too: at most 7 bytes of padding,
none for the usual models.

A buffer is a numpy ``uint8`` array or a ``uint8`` torch tensor (a GPU
message buffer, :mod:`mpifl.transport.buffers`); its views are of the same kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Union

import numpy as np
import torch

Buffer = Union[np.ndarray, torch.Tensor]  # uint8, one dimension

_NUMPY_DTYPE = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


ALIGN = 8  # the largest item size: what a layout's size is rounded up to
#: what a tensor on the wire is computed from, beyond the model's weights ("") and their updates
DATA_DERIVED = ("data statistics", "images or spectra", "prototypes", "scores")
EXPOSES = ("",) + DATA_DERIVED


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor that crosses the wire.

    ``derived``: what of a client's data the tensor is computed from (image or feature statistics, mean
    images, prototypes, spectra, styles), which ``--show-manifest`` marks; empty for model parameters and
    their updates.  ``exposes``: its kind among :data:`EXPOSES` (a data-derived tensor names one; else it is
    model weights going down, a model update going up).  Both are labels only: two specs that differ in them
    alone are equal.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    derived: str = field(default="", compare=False)
    exposes: str = field(default="", compare=False)

    def __post_init__(self):
        if self.exposes not in EXPOSES or bool(self.derived) != (self.exposes in DATA_DERIVED):
            raise TypeError(f"tensor {self.name}: a data-derived tensor says what it exposes, one of "
                            f"{', '.join(DATA_DERIVED)}, and only it (got {self.exposes!r})")

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def numpy_dtype(self):
        return _NUMPY_DTYPE[self.dtype]


class WireLayout:
    """Offsets of named tensors inside one flat byte buffer."""

    def __init__(self, specs: Iterable[TensorSpec]):
        specs = list(specs)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tensor names in wire layout: {names}")
        # Stable sort by item size, largest first: aligned views, no padding.
        self.specs = sorted(specs, key=lambda s: -s.itemsize)
        self.offsets: dict[str, int] = {}
        offset = 0
        for spec in self.specs:
            self.offsets[spec.name] = offset
            offset += spec.nbytes
        self.used = offset  # bytes of tensors; the rest of nbytes is padding
        self.nbytes = -(-offset // ALIGN) * ALIGN
        self._by_name = {s.name: s for s in self.specs}

    def __len__(self) -> int:
        return len(self.specs)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def spec(self, name: str) -> TensorSpec:
        return self._by_name[name]

    def empty(self) -> np.ndarray:
        return np.empty(self.nbytes, dtype=np.uint8)

    def pack(self, tensors: Mapping[str, torch.Tensor], out: Buffer | None = None) -> Buffer:
        """Copy exactly the layout's tensors into ``out`` (a new buffer if None).

        The keys of ``tensors`` must equal the layout's names: the runtime moves
        nothing that the share policy did not declare, and nothing is missing.
        """
        if set(tensors) != set(self._by_name):
            extra = sorted(set(tensors) - set(self._by_name))
            missing = sorted(set(self._by_name) - set(tensors))
            raise ValueError(f"tensors do not match the wire layout: extra {extra}, missing {missing}")
        buf = self.empty() if out is None else out
        views = self.unpack(buf)
        for name, tensor in tensors.items():
            src = tensor.detach()
            if tuple(src.shape) != views[name].shape:
                raise ValueError(f"{name}: shape {tuple(src.shape)} != layout {views[name].shape}")
            torch.as_tensor(views[name]).copy_(src)  # one copy into the buffer, casting to the layout dtype
        buf[self.used:self.nbytes] = 0  # the padding: no stale bytes on the wire
        return buf

    def unpack(self, buf: Buffer) -> dict[str, Buffer]:
        """Zero-copy views of every tensor inside ``buf`` (numpy arrays or tensors, as ``buf``)."""
        if buf.nbytes != self.nbytes:
            raise ValueError(f"buffer of {buf.nbytes} bytes for a layout of {self.nbytes}")
        return {s.name: self._view(buf, s) for s in self.specs}

    def _view(self, buf: Buffer, spec: TensorSpec) -> Buffer:
        start = self.offsets[spec.name]
        raw = buf[start:start + spec.nbytes]
        return raw.view(spec.dtype if isinstance(raw, torch.Tensor) else spec.numpy_dtype).reshape(spec.shape)


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """Specs for a dict of tensors, in its order."""
    return [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
