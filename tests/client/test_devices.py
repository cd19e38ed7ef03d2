"""Node-local GPU binding and --deterministic's kernel settings."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mpifl.client.devices import deterministic_kernels, pick_device, training_cores
from mpifl.client.host import ClientHost
from mpifl.errors import MpiflError
from mpifl.models.pooling import global_avg_pool
from mpifl.transport.topology import NodeLayout


def _layout(rank: int, node_ranks: tuple[int, ...]) -> NodeLayout:
    return NodeLayout(hostname="n", rank=rank, node_ranks=node_ranks,
                      client_ranks=tuple(r for r in node_ranks if r), cores=16, sharing=1)


@pytest.mark.parametrize("node_ranks,gpus,expected", [
    ((0, 1, 2, 3, 4), 4, {1: 0, 2: 1, 3: 2, 4: 3}),  # the server's node: client ranks from GPU 0
    ((5, 6, 7, 8, 9, 10, 11, 12), 4, {5: 0, 6: 1, 7: 2, 8: 3, 9: 0, 10: 1, 11: 2, 12: 3}),  # a second node, 2 per GPU
    ((3, 4), 1, {3: 0, 4: 0}),  # one visible GPU (Slurm's --gpus-per-task=1): every rank takes it
])
def test_client_ranks_take_their_nodes_gpus_round_robin_by_node_local_index(monkeypatch, node_ranks, gpus, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert {r: pick_device("auto", _layout(r, node_ranks)).index for r in node_ranks if r} == expected


def test_a_rank_training_on_a_gpu_keeps_one_core_busy_whatever_its_torch_threads():
    assert training_cores(torch.device("cpu"), 6) == 6
    assert training_cores(torch.device("cuda", 1), 6) == 1


def test_deterministic_kernels_set_torch_cublas_and_cudnn_for_a_gpu_and_leave_a_cpu_alone(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode: calls.append(mode))
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    deterministic_kernels(torch.device("cpu"))
    assert calls == [] and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    deterministic_kernels(torch.device("cuda", 0))
    assert calls == [True] and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def test_global_average_pooling_is_the_adaptive_pool():
    x = torch.randn(3, 5, 7, 7, dtype=torch.float64)
    assert torch.equal(global_avg_pool(x), F.adaptive_avg_pool2d(x, 1))
    assert torch.allclose(global_avg_pool(x), x.mean((2, 3), keepdim=True))  # what --deterministic uses on a GPU


def test_a_kernel_without_a_deterministic_version_is_one_line_naming_the_option():
    def kernel_refused():
        raise RuntimeError("adaptive_max_pool2d_backward_cuda does not have a deterministic implementation, but you "
                           "set 'torch.use_deterministic_algorithms(True)'. You can turn off determinism ...")

    host = SimpleNamespace(_run=kernel_refused, clients=SimpleNamespace(close=lambda: None))
    with pytest.raises(MpiflError, match=r"^--deterministic: adaptive_max_pool2d_backward_cuda does not have a "
                                         r"deterministic implementation in this model, .* run without --deterministic$"):
        ClientHost.run(host)
    host._run = lambda: (_ for _ in ()).throw(RuntimeError("CUDA out of memory"))  # any other error stays a bug
    with pytest.raises(RuntimeError, match="out of memory"):
        ClientHost.run(host)
