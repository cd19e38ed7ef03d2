"""Node-local GPU binding and per-rank CPU threads (README, "How a run works")."""

from __future__ import annotations

import torch

from ..transport.topology import NodeLayout
from ..errors import MpiflError


def pick_device(requested: str, layout: NodeLayout) -> torch.device:
    """A client rank's device: GPU (its index among the node's client ranks) mod (GPUs on the node).

    Binding uses the node-local position, so it is right on multi-node jobs.
    ``auto`` falls back to the CPU when no GPU is visible; ``cuda`` insists.
    """
    if requested == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        if requested == "cuda":
            raise MpiflError(f"--device cuda was given but no CUDA GPU is visible on {layout.hostname}; "
                             "use --device cpu (or auto), or run on a GPU node")
        return torch.device("cpu")
    return torch.device("cuda", max(layout.client_index, 0) % count)


def threads_for(layout: NodeLayout, requested: int) -> int:
    """Intra-op threads so that the client ranks of a node never oversubscribe its cores.

    ``cores`` are the cores this rank may use (affinity); ``sharing`` counts
    the node's client ranks whose cores overlap them.  Unbound ranks split
    the node; ranks bound to their own cores use all of theirs.  The server
    rank sleeps while clients train and takes no share.
    """
    return requested if requested > 0 else max(1, layout.cores // layout.sharing)
