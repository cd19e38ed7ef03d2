#!/usr/bin/env python3
"""A fingerprint of every algorithm's numbers, to show that a change of code leaves results bit for bit.

    python launch/fingerprint.py OUT [ALGO ...]          # this checkout: every algorithm (or those named)
    git worktree add ../before main && python launch/fingerprint.py OUT2 --code ../before
    diff OUT/fingerprints.json OUT2/fingerprints.json
    python launch/fingerprint.py OUT3 --with=--fold-threads=3   # an option that must leave the numbers as they are
    diff OUT/fingerprints.json OUT3/fingerprints.json           # only the "with" entry may differ

Each algorithm runs 2 rounds in one process (no launcher), ``--seed 0 --threads 1``, on the generated
styledigits set with ``smallcnn``: 10 clients (2 per domain), half of them per round, 64 training images each,
an evaluation every round and a checkpoint after the last (CCST on random AdaIN weights, one stylized version
of 32 images per client).  Its fingerprint is the sha256 of its ``metrics.jsonl`` without the timing and memory
fields, and of every tensor of its last checkpoint: the server's state and each client's private state.  The
numbers are those of the checkout ``--code`` names (default: the one this script is in), whose
``python -m mpifl.run`` runs them (a folder without mpifl, or one whose Python would import another mpifl, such
as an installed one, is refused); the fingerprints are computed here, so two checkouts of different layouts
compare.  An algorithm whose run fails is recorded as ``failed: <its last line>``.  ``fingerprints.json`` holds
``{"with": [the --with options], "algorithms": {algorithm: fingerprint}}``.

``--with`` adds an option to every run, to show that it leaves every number as it is; so it takes only the
options that cannot change them: of those a resumed run may change (``mpifl.plan.config.RESUMABLE``: how a run
runs, not what it computes), the ones whose numbers the docs promise bit for bit.  Not --rounds, --data-root,
--threads (CPU kernels round by their thread count) or --ckpt-every (the checkpoint it hashes), which this script
sets; not --device or --deterministic (other kernels); not --eval-batch-size or --stream-above (other evaluation
batches, summed in another order).  Any other option is refused in one line, before anything runs.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: What a method needs to run small: FixBN switches stage, FedBABU fine-tunes one epoch, CCST stylizes little.
OWN_OPTIONS = {"fixbn": ["--fixbn-stage-rounds", "1"], "fedbabu": ["--fedbabu-finetune-epochs", "1"],
               "ccst": ["--ccst-k", "1", "--samples-per-client", "32"]}
UNTIMED = ("seconds", "rank_seconds", "memory")  # what differs from one run of the same numbers to the next
#: What --with takes, of mpifl.plan.config.RESUMABLE: rank 0's fold cores (the same bits for any count), the
#: clients' private state kept in memory (results identical), the timeouts, where GPU messages live, the live
#: trackers (they read the records)
NEUTRAL = ("fold_threads", "private_memory", "round_timeout", "peer_timeout", "gpu_buffers", "track")
#: and what it refuses (the module's docstring says why; a streamed split's evaluation batches end at its blocks:
#: docs/design.md, "Evaluation, spread by batches"); the two are all of RESUMABLE (tests/test_fingerprint.py)
CHANGING = ("rounds", "data_root", "threads", "ckpt_every", "device", "deterministic", "eval_batch_size",
            "stream_above")


def run_args(algo: str, data_root: Path, out: Path, style_model: Path) -> list[str]:
    own = OWN_OPTIONS.get(algo, [])
    images = [] if "--samples-per-client" in own else ["--samples-per-client", "64"]
    style = ["--style-model", str(style_model)] if algo == "ccst" else []
    return ["--algo", algo, "--data-root", str(data_root), "--model", "smallcnn", "--out", str(out),
            "--rounds", "2", "--seed", "0", "--threads", "1", "--lr", "0.05", "--momentum", "0.9",
            "--clients-per-domain", "2", "--fraction", "0.5", "--eval-every", "1", "--ckpt-every", "2",
            *images, *style, *own]


def untimed(record):
    if isinstance(record, dict):
        return {k: untimed(v) for k, v in record.items() if k not in UNTIMED}
    if isinstance(record, list):
        return [untimed(v) for v in record]
    return record


def _hash_state(digest, name: str, value) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _hash_state(digest, f"{name}/{key}", value[key])
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _hash_state(digest, f"{name}[{i}]", item)
    else:
        digest.update(f"{name}={value!r}".encode())


def fingerprint(run: Path) -> str:
    """sha256 of the run's untimed records and of every tensor in its last checkpoint, in a fixed order."""
    import torch

    from mpifl.rundir.names import CHECKPOINT, METRICS
    digest = hashlib.sha256()
    records = [untimed(json.loads(line)) for line in (run / METRICS).read_text().splitlines()]
    digest.update(json.dumps(records, sort_keys=True).encode())
    for path in sorted((run / CHECKPOINT).rglob("*")):
        if path.suffix == ".pt":
            _hash_state(digest, path.name, torch.load(path, map_location="cpu", weights_only=True))
        elif path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                for member in sorted(archive.namelist()):
                    state = torch.load(io.BytesIO(archive.read(member)), map_location="cpu", weights_only=True)
                    _hash_state(digest, f"{path.name}:{member}", state)
    return digest.hexdigest()[:16]


def check_with(words: list[str]) -> None:
    """Exit with one line unless ``words`` (the --with options, one word each: ``--fold-threads=3``, or
    ``--fold-threads`` then ``3``) are options of :data:`NEUTRAL` with values mpifl takes."""
    import click

    from mpifl.errors import MpiflError
    from mpifl.job.cli import configuration, usage_line

    for i, word in enumerate(words):
        if i and words[i - 1].startswith("--") and "=" not in words[i - 1]:
            continue  # the value of the option before
        key = word.lstrip("-").split("=", 1)[0].replace("-", "_")
        if not word.startswith("--") or key not in NEUTRAL:
            flags = ", ".join("--" + k.replace("_", "-") for k in NEUTRAL)
            sys.exit(f"fingerprint: --with {word}: --with takes only an option that cannot change the numbers: "
                     f"{flags} (see --help)")
    try:
        configuration(words)
    except click.ClickException as exc:
        sys.exit(f"fingerprint: --with {' '.join(words)}: {usage_line(exc)}")
    except MpiflError as exc:
        sys.exit(f"fingerprint: --with {' '.join(words)}: {exc}")


def algorithms_of(code: Path, env: dict) -> list[str]:
    """The algorithms of the mpifl in checkout ``code``, as ``python -m mpifl.run`` started there with ``env`` sees
    them; one line (exit) when ``code`` holds no mpifl or that Python would import another (an installed one)."""
    if not (code / "mpifl" / "__init__.py").is_file():
        what = "does not exist" if not code.exists() else "holds no mpifl package (mpifl/__init__.py)"
        sys.exit(f"fingerprint: --code {code} {what}; pass a checkout of mpifl")
    listing = "import mpifl; from mpifl.algorithms import ALGORITHMS; print(mpifl.__file__); print(*ALGORITHMS)"
    job = subprocess.run([sys.executable, "-c", listing], cwd=code, env=env, capture_output=True, text=True)
    if job.returncode:
        sys.exit(f"fingerprint: cannot import the mpifl of {code}: {(job.stderr.strip().splitlines() or ['?'])[-1]}")
    imported, names = job.stdout.splitlines()[-2:]
    if Path(imported).resolve().parent != (code / "mpifl").resolve():
        sys.exit(f"fingerprint: --code {code}: its Python imports mpifl from {Path(imported).parent}, not from "
                 f"{code / 'mpifl'}; the numbers would not be that checkout's")
    return names.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n")[-1].replace("``", ""))
    parser.add_argument("out", type=Path, help="a new folder: data, runs and fingerprints.json go there")
    parser.add_argument("algos", nargs="*", help="the algorithms (default: every registered one)")
    parser.add_argument("--code", type=Path, default=REPO, help="the checkout whose numbers (default: this one)")
    parser.add_argument("--with", dest="extra", action="append", default=[], metavar="OPTION",
                        help="an option added to every run, e.g. --with=--fold-threads=3; only one that cannot change "
                             "the numbers (below): " + ", ".join("--" + k.replace("_", "-") for k in NEUTRAL))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from mpifl.models.adain import save_random_style_model

    check_with(args.extra)

    if args.out.exists():
        sys.exit(f"fingerprint: {args.out} exists; pass a new folder")
    code = args.code.resolve()
    env = {**os.environ, "PYTHONPATH": str(code)}
    registered = algorithms_of(code, env)
    unknown = [a for a in args.algos if a not in registered]
    if unknown:
        sys.exit(f"fingerprint: unknown algorithm {', '.join(unknown)}; choose from {', '.join(registered)}")
    out = args.out.resolve()
    style_model = save_random_style_model(out / "style-model")
    prints = {}
    for algo in args.algos or registered:
        run = out / "runs" / algo
        job = subprocess.run([sys.executable, "-m", "mpifl.run", *run_args(algo, out / "data", run, style_model),
                              *args.extra],
                             cwd=code, env=env, capture_output=True, text=True)
        last = (job.stderr.strip().splitlines() or [f"exit {job.returncode}"])[-1]
        prints[algo] = fingerprint(run) if job.returncode == 0 else f"failed: {last}"
        print(f"{algo} {prints[algo]}", flush=True)
    (out / "fingerprints.json").write_text(json.dumps({"with": args.extra, "algorithms": prints}, indent=1) + "\n")


if __name__ == "__main__":
    main()
