"""Every name a run writes into its directory, in one block.  The writer (:mod:`.rundir`, :mod:`.checkpoint`), the
reports, analyses, benchmarks and launch scripts take these names from here; :data:`RUN_FILES` (what makes a
directory a run's) is built from them.  Imports nothing beyond the standard library, so any Python can ask it
(``python -c 'from mpifl.rundir.names import METRICS; print(METRICS)'``)."""

from __future__ import annotations

from pathlib import Path

from ..dirlock import LOCK_NAME

CONFIG = "config.json"  # the resolved configuration, loadable with --config; a resumed run reads it back
METRICS = "metrics.jsonl"  # one line per round (mpifl.server.run_log)
LOG = "log.txt"  # what rank 0 printed, and each rank's start line
SUMMARY_CSV = "summary.csv"  # test accuracy per domain at the last and the best round
SUMMARY_MD = "summary.md"  # the same as a table; under --holdout all, the fold table
CHECKPOINT = "checkpoint"  # the last complete checkpoint (below)
TRACEBACKS = "traceback-rank*.txt"  # a bug's traceback, one file per failed rank (traceback_file)
ATTEMPTS = "attempts"  # a resumed run's earlier attempts: attempts/<k>/ holds the k-th one's tracebacks
TRACKING = "tracking"  # --track: what the live trackers write by default (mpifl.server.tracking)
HOLDOUT_FOLD = "holdout-{domain}"  # --holdout all: one fold run per domain, beside its SUMMARY_MD
TMP = ".tmp"  # suffix of a file being written; renamed over its name once complete
# Inside CHECKPOINT (mpifl.rundir.checkpoint): which round is complete, and per round R the server's file and one
# file per client rank, a zip of one member per client that has trained and one of the adopted entries.
CHECKPOINT_META = "meta.json"
ROUND_DIR = "round-{round}"
SERVER_FILE = "server.pt"
RANK_FILE = "rank-{rank}.zip"
CLIENT_MEMBER = "client-{client}.pt"
ADOPTED_MEMBER = "adopted.pt"

#: What a run writes into its directory: the names above (``--holdout all``: a folder of fold runs and their table).
RUN_FILES = (CONFIG, METRICS, LOG, SUMMARY_CSV, SUMMARY_MD, CHECKPOINT, TRACEBACKS, HOLDOUT_FOLD.format(domain="*"),
             CONFIG + TMP, METRICS + TMP, ATTEMPTS, TRACKING)
#: What marks a directory as one run's own: its first file, its records, its checkpoints, a live run's claim.
RUN_MARKS = (CONFIG, METRICS, CHECKPOINT, LOCK_NAME)


def traceback_file(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s traceback of a bug goes."""
    return run_dir / TRACEBACKS.replace("*", str(rank))


def holdout_fold(base: Path, domain: str) -> Path:
    """The run directory of ``--holdout all``'s fold that holds ``domain`` out, inside ``base``."""
    return base / HOLDOUT_FOLD.format(domain=domain)
