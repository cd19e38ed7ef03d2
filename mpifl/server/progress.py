"""Rank 0's progress line: rounds done, last mean score (accuracy, or Dice), elapsed and ETA.

On a terminal the line is redrawn in place; in a batch log (Slurm) one line
is printed per evaluation round instead, so logs stay readable.
"""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, stream=None, width: int = 24, metric: str = "acc"):
        self.total, self.width, self.metric = total, width, metric
        self.stream = stream or sys.stdout
        self.start = time.monotonic()
        self.tty = self.stream.isatty()
        self._last_acc: float | None = None
        self._last_done = 0

    def update(self, done: int, acc: float | None) -> None:
        if done == self._last_done:
            return
        self._last_done = done
        elapsed = time.monotonic() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        filled = int(self.width * done / self.total)
        acc_text = "  -  " if acc is None else f"{100 * acc:5.1f}%"
        line = (f"round {done:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"mean {self.metric} {acc_text}  elapsed {_clock(elapsed)}  eta {_clock(eta)}")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done == self.total else ""))
        elif acc != self._last_acc or done == self.total:
            self.stream.write(line + "\n")
        self._last_acc = acc
        self.stream.flush()
