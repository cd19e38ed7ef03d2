"""What every tracker does (:class:`Tracker`), and what it is told of the run it tracks (:class:`TrackedRun`).

A tracker's methods are called in order from one thread of its own (:mod:`.live`), never from the round loop;
each may raise, and a tracker that raises is dropped.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ...rundir.names import TRACKING

#: what a tracker run ends as: the run finished, a signal stopped it (to be resumed), or the tracker failed
FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"


@dataclass(frozen=True)
class TrackedRun:
    """The run a tracker tracks."""

    path: Path  # the run directory
    name: str  # shown as the tracker run's name: the run directory's name (a fold's: <folder>/holdout-<domain>)
    group: str | None  # --holdout all: the folder of its folds, which each fold's tracker run names
    config: dict  # the options, as config.json holds them
    continues: str | None  # the tracker's run of the checkpoint, which a resumed run continues; None: a new one
    first_round: int  # the first round this part of the run logs to a continued tracker run

    @property
    def logs_from(self) -> int:
        """The first round a tracker logs: :attr:`first_round` where it continues a tracker run, else 1 (a resumed
        run's earlier rounds too)."""
        return self.first_round if self.continues else 1

    @property
    def folder(self) -> Path:
        """Where a tracker writes by default: ``<run>/tracking``."""
        return self.path / TRACKING


class Tracker:
    """One tracker's run: opened by the constructor (may raise: the run is then refused), then :meth:`log` per
    round, :meth:`attach` at the end of a finished run, :meth:`close` last."""

    name: ClassVar[str]  # as --track names it, and the extra that installs it: pip install 'mpifl[<name>]'

    run_id: str  # what the checkpoint keeps, so that a resumed run continues this tracker run
    first_round: int  # the first round to log (TrackedRun.logs_from)

    @classmethod
    def modules(cls) -> tuple[str, ...]:
        """The packages it imports: by default the one of its :attr:`name`."""
        return (cls.name,)

    @classmethod
    def missing(cls) -> list[str]:
        """Those of :meth:`modules` that are not installed."""
        return [name for name in cls.modules() if importlib.util.find_spec(name) is None]

    def log(self, step: int, values: dict[str, float]) -> None:
        """One round's scalars (:mod:`mpifl.server.scalars`), at step = the round."""
        raise NotImplementedError

    def attach(self, files: dict[str, Path], summary: str, step: int) -> None:
        """A finished run's files, by the name each is attached under (``config.json``, ``summary.md``,
        ``summary.csv``, ``report/<file>``: the report's tables and figures), and its summary table (markdown),
        after round ``step``."""
        raise NotImplementedError

    def close(self, status: str) -> None:
        """End the tracker run as :data:`FINISHED`, :data:`STOPPED` or :data:`FAILED`."""
        raise NotImplementedError
