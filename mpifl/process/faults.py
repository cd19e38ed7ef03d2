"""Test-only fault injection, driven by the ``MPIFL_FAULT`` environment variable.

``MPIFL_FAULT="KIND:key=value,..."`` fires when every given key matches the
point reached: ``rank``, ``client``, ``round``.  Kinds:

* ``raise`` - an unexpected exception (a bug on one rank);
* ``exit``  - the process dies without a word (a crash, the OOM killer);
* ``kill``  - the process is killed by SIGKILL (what the OOM killer does);
* ``hang``  - the process stops answering (a deadlock, a stuck file system);
* ``stop``  - SIGTERM to this process (a scheduler's stop request);
* ``pause`` - the process goes on after :data:`PAUSE_SECONDS` (a rank slow to finish: a busy file system);
* ``nan``   - the client's weights become NaN before local training (divergence).

Client ranks check before training each client (``client`` = its id), the
server before each round's message (``rank=0``, ``client=-1``), and every
rank once while ``mpifl.run`` starts (``round=0``, ``client=-1``) and once
as its part of the job ends, every result written (``round`` = ``--rounds`` + 2,
after the final message R + 1; ``client=-1``).

Unset in normal runs; the failure tests use it to show that any rank's fault
ends the whole job promptly with one message.
"""

from __future__ import annotations

import os
import signal
import time

PAUSE_SECONDS = 3.0


def _parse(text: str) -> tuple[str, dict[str, int]]:
    kind, _, where = text.partition(":")
    coords = dict(item.split("=", 1) for item in where.split(",") if item)
    return kind.strip(), {k.strip(): int(v) for k, v in coords.items()}


def maybe_inject(*, rank: int, client: int, round_index: int) -> str | None:
    """Fire the configured fault here if it matches; returns "nan" for the caller to apply."""
    text = os.environ.get("MPIFL_FAULT")
    if not text:
        return None
    kind, coords = _parse(text)
    here = {"rank": rank, "client": client, "round": round_index}
    if any(here.get(k) != v for k, v in coords.items()):
        return None
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank}, client {client}, round {round_index}")
    if kind == "exit":
        os._exit(17)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGTERM)
        return None
    if kind == "pause":
        time.sleep(PAUSE_SECONDS)
        return None
    if kind == "nan":
        return "nan"
    raise ValueError(f"unknown MPIFL_FAULT kind {kind!r}")
