"""Every privacy mechanism at once gives the same bits in this process, in a process of its own, on 1, 2 and 3
client ranks, and after a stop and ``--resume`` on another rank count: FedWon with its adaptive gradient clipping
under DP-SGD (Poisson batches, per-record noise), its updates clipped under adaptive client-level DP (Poisson
clients, noise from (seed, round)), masked under secure aggregation (fresh Diffie-Hellman keys in every process)."""

from __future__ import annotations

import pytest
import torch

from mpifl.privacy.client_dp import HISTORY

from ..conftest import everywhere

pytestmark = pytest.mark.slow


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--algo", "fedwon",
            "--agc-clip", "0.64", "--lr", "0.05", "--threads", "1", "--clients-per-domain", "2",
            "--samples-per-client", "48", "--batch-size", "16", "--rounds", "4", "--fraction", "0.5",
            "--seed", "6",  # its Poisson sample has no round of one client (secure aggregation refuses one)
            "--dpsgd-clip", "1", "--dpsgd-noise", "1", "--dp-clip", "0.3", "--dp-noise", "0.8",
            "--dp-clipping", "adaptive", "--dp-count-noise", "1", "--secure-aggregation", "--ckpt-every", "1",
            *extra]


def test_every_mechanism_at_once_gives_the_same_bits_on_any_rank_count_and_after_a_resume(data_root, tmp_path):
    numbers = everywhere(lambda out: _args(data_root, out), tmp_path)
    assert all(n == numbers["here"] for n in numbers.values())
    records = numbers["here"]
    assert len({r["privacy"]["clip"] for r in records}) == 4  # adaptive: C moved every round
    assert all(r["dp_sgd"]["epsilon_max"] > 0 for r in records)
    final = {name: torch.load(tmp_path / name / "checkpoint" / "round-4" / "server.pt", weights_only=True)
             for name in numbers}
    for state in final.values():
        assert torch.equal(state["extra"][HISTORY], final["here"]["extra"][HISTORY])
        assert all(torch.equal(state["model"][k], final["here"]["model"][k]) for k in state["model"])
    assert "secure aggregation: masked uploads" in (tmp_path / "n3" / "log.txt").read_text()
