"""Simulated client conditions give the same bits, simulated clock included, in this process, in a process of its
own, on 1, 2 and 3 client ranks, and after a stop and ``--resume`` on another rank count: synchronous rounds with
every condition at once (lognormal speeds, per-domain availability, a deadline with partial work, dropouts before
and after training, over-selection), and FedBuff's asynchronous steps, whose held uploads cross the checkpoint."""

from __future__ import annotations

import pytest
import torch

from ..conftest import everywhere

pytestmark = pytest.mark.slow

COMMON = ("--model", "smallcnn", "--lr", "0.05", "--threads", "1", "--clients-per-domain", "2",
          "--samples-per-client", "48", "--batch-size", "16", "--rounds", "4", "--seed", "3", "--ckpt-every", "1",
          "--client-speed", "lognormal:40,0.8", "--client-bandwidth", "uniform:1,4")
CASES = {
    "sync": ("--algo", "fedprox", "--fraction", "0.5", "--availability", "mono=0.3,texture=0.6", "--deadline", "2.2",
             "--late", "partial", "--drop-before", "0.1", "--drop-after", "0.1", "--over-select", "2"),
    "async": ("--algo", "fedbuff", "--concurrency", "6", "--buffer-size", "3", "--drop-after", "0.15"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_conditions_give_the_same_bits_on_any_rank_count_and_after_a_resume(data_root, tmp_path, case):
    numbers = everywhere(lambda out: ["--data-root", str(data_root), "--out", str(out), *COMMON, *CASES[case]],
                         tmp_path)
    assert all(n == numbers["here"] for n in numbers.values())
    records = numbers["here"]
    times = [r["sim"]["time"] for r in records]
    assert times == sorted(times) and times[0] > 0  # the simulated clock runs
    if case == "sync":  # every condition happened in these rounds
        happened = {why for r in records for why in r["sim"] if why not in ("seconds", "time")}
        assert {"cut", "lost", "over_selected"} <= happened, happened
    else:  # a server step on every 3 arrivals, some of them stale
        assert all(len(r["clients"]) == 3 for r in records)
        assert any(max(r["sim"]["staleness"]) > 0 for r in records)
    final = {name: torch.load(tmp_path / name / "checkpoint" / "round-4" / "server.pt", weights_only=True)
             for name in numbers}
    for state in final.values():
        assert all(torch.equal(state["model"][k], final["here"]["model"][k]) for k in state["model"])
