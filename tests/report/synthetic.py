"""Synthetic run directories: config.json and metrics.jsonl in the format of mpifl.server.run_log, with known numbers."""

from __future__ import annotations

import json
from pathlib import Path

from mpifl.plan.config import RunConfig


def write_run(path: Path, acc: dict, val: list[float], *, kinds=("global",), holdout: str | None = None,
              bytes_down=1000, seconds=0.5, metric="acc", sim: list[float] | None = None, **config) -> Path:
    """A run whose test accuracy of every kind is ``acc[domain][r - 1]`` in round r (fractions) and whose mean
    validation accuracy is ``val[r - 1]`` (for the evaluated and the post-training local models); ``config`` goes to
    :class:`RunConfig` (``out`` is ``path``); ``metric="dice"``: a segmentation run's records, the same numbers;
    ``sim``: the simulated time at the end of each round (a run with a simulated clock)."""
    path.mkdir(parents=True, exist_ok=True)
    flat = RunConfig(out=str(path), holdout=holdout, **config).to_flat()
    (path / "config.json").write_text(json.dumps(flat, indent=2))
    domains = list(acc)
    sources = [d for d in domains if d != holdout]
    lines = []
    for r in range(1, len(val) + 1):
        scores = {d: {metric: acc[d][r - 1], "loss": 1.0 / r, "n": 100} for d in domains}
        mean = sum(acc[d][r - 1] for d in sources) / len(sources)
        evaluation = {kind: {"test": {"mean": {metric: mean, "loss": 1.0 / r}, "domains": scores, "clients": {}},
                             "val": {"mean": {metric: val[r - 1], "loss": 1.0}, "domains": scores, "clients": {}}}
                      for kind in kinds}
        lines.append({"round": r, "clients": [0, 1], "train": {"loss": 2.0 / r, metric: 0.1 * r, "local_val_acc": val[r - 1]},
                      "bytes": {"down": bytes_down * r, "up": 500, "wire_down": 2000, "wire_up": 600},
                      "seconds": {"round": seconds * r, "compute": 0.1, "evaluation": 0.01, "communication": 0.01,
                                  "waiting": 0.0, "aggregation": 0.001},
                      "eval": evaluation}
                     | ({"sim": {"seconds": sim[r - 1] - (sim[r - 2] if r > 1 else 0.0), "time": sim[r - 1]}}
                        if sim else {}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
