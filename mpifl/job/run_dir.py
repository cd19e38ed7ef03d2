"""The run directory: ``--out`` or ``runs/<algo>-<data>-<model>-s<seed>-<time>``, with the resolved
``config.json`` that ``--config`` and ``--resume`` read back."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from ..errors import MpiflError
from ..plan.config import RunConfig


def make_run_dir(cfg: RunConfig) -> Path:
    """A new run's directory with its ``config.json``; refused if ``--out`` already holds a run."""
    if cfg.out:
        path = Path(cfg.out)
        if (path / "metrics.jsonl").exists():
            raise MpiflError(f"run directory {path} already holds a run; pass another --out or remove it")
    else:
        path = default_run_dir(cfg)
    path.mkdir(parents=True, exist_ok=True)
    _write_config(path, cfg)
    return path


def resume_run_dir(cfg: RunConfig) -> Path:
    """The resumed run's directory; its ``config.json`` takes the new --rounds etc."""
    path = Path(cfg.out)
    _write_config(path, cfg)
    return path


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = path = Path("runs") / f"{cfg.algo}-{cfg.data}-{cfg.model}-s{cfg.seed}-{stamp}"
    suffix = 1
    while path.exists():
        path = base.with_name(f"{base.name}_{suffix}")
        suffix += 1
    return path


def _write_config(path: Path, cfg: RunConfig) -> None:
    """Atomically (temp file + rename): the other ranks of a resumed run may be reading it."""
    tmp = path / "config.json.tmp"
    tmp.write_text(json.dumps(cfg.to_flat(), indent=2) + "\n")
    os.replace(tmp, path / "config.json")
