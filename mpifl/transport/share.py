"""What a method shares: the tensors that cross the wire in each direction per participating client, and
those a client keeps.  Each algorithm states one (:meth:`mpifl.algorithms.core.helpers.AlgorithmHelpers.policy`);
the message layouts (:mod:`.messages`) and ``--show-manifest`` (:mod:`.manifest`) are made from it."""

from __future__ import annotations

from dataclasses import dataclass

from .wire import TensorSpec


@dataclass(frozen=True)
class SharePolicy:
    """Tensors per direction per participating client, and those a client keeps."""

    download: list[TensorSpec]
    upload: list[TensorSpec]
    private: list[TensorSpec]
    gathered: tuple[str, ...] = ()  # uploads rank 0 receives from every client whole; the rest are folded
