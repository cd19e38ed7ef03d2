"""Node-local GPU binding, per-rank CPU threads and deterministic GPU kernels (docs/design.md, "How a round
is computed")."""

from __future__ import annotations

import os

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


def training_cores(device: torch.device, threads: int) -> int:
    """The cores a client rank keeps busy while it trains: its torch threads on the CPU; on a GPU one, the
    thread that launches the kernels (its torch threads serve the little it computes on the CPU)."""
    return threads if device.type == "cpu" else 1


def deterministic_kernels(device: torch.device) -> None:
    """``--deterministic``: on a GPU, kernels that give the same bits for the same inputs in every run.

    ``torch.use_deterministic_algorithms`` (an operation with no deterministic CUDA kernel then raises, see
    :func:`mpifl.models.pooling.global_avg_pool`), cuBLAS with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``,
    read when its first handle is made, so before any GPU work) and cuDNN without benchmarking, restricted
    to its deterministic algorithms.  CPU kernels are deterministic already: nothing changes there.
    """
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
