"""What the runtime asks of a run's privacy mechanism, at the four places where one acts on a round: the wire
manifest, a client's upload before it is packed, the sums rank 0 folds, and the sums before the method's
:meth:`~mpifl.algorithms.Algorithm.aggregate` reads them.  :class:`Privacy` is a run without one: each step leaves
what it is given as it is."""

from __future__ import annotations

import numpy as np
import torch

from ..algorithms import Reduction, ServerState
from ..transport.share import SharePolicy
from ..transport.wire import TensorSpec


class Privacy:
    """No mechanism: the method's manifest, uploads and sums as they are."""

    #: a round in which no upload arrives still takes a server step (client-level DP's noise); else it leaves the
    #: global state as it was
    steps_without_clients = False

    def policy(self, policy: SharePolicy) -> SharePolicy:
        """The wire manifest: the method's, and the mechanism's own tensors."""
        return policy

    def privatize(self, upload: dict[str, torch.Tensor], download: dict[str, torch.Tensor], client: int,
                  round_index: int) -> dict[str, torch.Tensor]:
        """A trained client's upload as it leaves its host rank."""
        return upload

    def init_server(self, state: ServerState) -> None:
        """The mechanism's tensors in a new run's server state (what a checkpoint keeps)."""

    def download(self, state: ServerState) -> dict[str, torch.Tensor]:
        """The mechanism's tensors of the round's download."""
        return {}

    def reductions(self, reductions: dict[str, Reduction], clients: np.ndarray) -> dict[str, Reduction]:
        """The sums rank 0 folds, from the method's (``clients``: the round's, in id order)."""
        return reductions

    def release(self, state: ServerState, sums: dict[str, np.ndarray], clients: np.ndarray, round_index: int) -> None:
        """The folded ``sums`` made into what the method aggregates, in place."""

    def record(self, state: ServerState) -> dict | None:
        """The guarantee so far, for the round's record in ``metrics.jsonl`` (None: no mechanism)."""
        return None

    def covers(self, spec: TensorSpec, direction: str) -> str:
        """Whether the mechanism covers a tensor of the manifest going ``direction`` ("down", "up", "setup"), in a
        few words for ``--show-manifest``."""
        return "not covered (no privacy mechanism)"

    def describe(self) -> str:
        """The mechanism, in one line of ``log.txt`` ("" for none)."""
        return ""
