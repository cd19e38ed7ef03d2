"""Simulated client conditions give the same bits, simulated clock included, in this process, in a process of its
own, on 1, 2 and 3 client ranks, and after a stop and ``--resume`` on another rank count: synchronous rounds with
every condition at once (lognormal speeds, per-domain availability, a deadline with partial work, dropouts before
and after training, over-selection), and FedBuff's asynchronous steps, whose held uploads cross the checkpoint."""

from __future__ import annotations

import pytest
import torch

from ..conftest import launch, read_metrics, run_here, run_in_process, untimed

pytestmark = pytest.mark.slow

COMMON = ("--model", "smallcnn", "--lr", "0.05", "--threads", "1", "--clients-per-domain", "2",
          "--samples-per-client", "48", "--batch-size", "16", "--rounds", "4", "--seed", "3", "--ckpt-every", "1",
          "--client-speed", "lognormal:40,0.8", "--client-bandwidth", "uniform:1,4")
CASES = {
    "sync": ("--algo", "fedprox", "--fraction", "0.5", "--availability", "mono=0.3,texture=0.6", "--deadline", "2.2",
             "--late", "partial", "--drop-before", "0.1", "--drop-after", "0.1", "--over-select", "2"),
    "async": ("--algo", "fedbuff", "--concurrency", "6", "--buffer-size", "3", "--drop-after", "0.15"),
}


def _numbers(run) -> list[dict]:
    """metrics.jsonl without timings, memory and the bytes on the wire (they depend on the placement)."""
    return [{k: v for k, v in r.items() if k != "bytes"} for r in untimed(read_metrics(run))]


@pytest.mark.parametrize("case", sorted(CASES))
def test_conditions_give_the_same_bits_on_any_rank_count_and_after_a_resume(data_root, tmp_path, case):
    def args(out):
        return ["--data-root", str(data_root), "--out", str(tmp_path / out), *COMMON, *CASES[case]]

    runs = {"here": run_here(*args("here")), "one": run_in_process(*args("one"))}
    for n in (2, 3, 4):
        runs[f"n{n}"] = launch(n, *args(f"n{n}"))
    stopped = launch(3, *args("resumed"), env={"MPIFL_FAULT": "stop:rank=0,round=3"})
    assert stopped.returncode == 75, stopped.stderr
    runs["resumed"] = run_in_process("--resume", str(tmp_path / "resumed"))
    for name, job in runs.items():
        assert job.returncode == 0, (name, job.stderr)
    numbers = {name: _numbers(tmp_path / name) for name in runs}
    assert all(n == numbers["here"] for n in numbers.values())
    records = numbers["here"]
    times = [r["sim"]["time"] for r in records]
    assert times == sorted(times) and times[0] > 0  # the simulated clock runs
    if case == "sync":  # every condition happened in these rounds
        happened = {why for r in records for why in r["sim"] if why not in ("seconds", "time")}
        assert {"cut", "lost", "over_selected"} <= happened, happened
    else:
        assert any(max(r["sim"]["staleness"]) > 0 for r in records)
    final = {name: torch.load(tmp_path / name / "checkpoint" / "round-4" / "server.pt", weights_only=True)
             for name in runs}
    for state in final.values():
        assert all(torch.equal(state["model"][k], final["here"]["model"][k]) for k in state["model"])
