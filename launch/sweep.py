#!/usr/bin/env python3
"""A grid of mpifl configurations, run one after another here or as one Slurm job array.

    python launch/sweep.py --grid lr=0.01,0.1 --grid algo=fedavg,fedbn --seeds 0,1,2 --local -- --rounds 50
    python launch/sweep.py --grid lr=0.01,0.1 --grid algo=fedavg,fedbn --slurm slurm/pacs.sh -- --rounds 50
    python launch/sweep.py ... --dry-run          # write the config files, print the commands, run nothing

The cartesian product of the ``--grid KEY=V1,V2,...`` lists (first grid outermost) and of ``--seeds``
(innermost) gives the points.  Each point becomes a JSON file of the keys ``python -m mpifl.run --config``
reads, in ``OUT/configs/``; ``OUT/configs.txt`` lists them, one a line, in point order.  Options after
``--`` are common to every point and go on each run's command line (they must not repeat a grid key).

``--local`` runs the points in order through ``launch/local.sh`` into ``OUT/runs/<point>`` (a point whose
run directory already holds ``summary.csv`` is skipped, so an interrupted sweep continues where it
stopped) and collects every run's mean test accuracy into ``OUT/results.csv``.

``--slurm SCRIPT`` submits ``sbatch --array=0-(N-1) SCRIPT`` once: task i runs point i (the script reads
``MPIFL_CONFIG_LIST``), into ``OUT/runs/<job name>-<array job>_<i>-<point>``; ``--sbatch-args`` adds
options (``"-p gpu -A project"``), ``--max-parallel K`` runs at most K tasks at a time.

Grid keys and the options after ``--`` are checked against mpifl's own options once, before any point starts
(with ``--local``, each point's whole configuration, as ``python -m mpifl.run`` resolves it).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "launch" / "local.sh"
sys.path.insert(0, str(REPO))  # this checkout's mpifl: its options, and the files of a run directory
import click  # noqa: E402  (after the path above)

from mpifl.algorithms import all_options  # noqa: E402
from mpifl.errors import MpiflError  # noqa: E402
from mpifl.job.cli import build_config, command  # noqa: E402
from mpifl.plan.config import CORE_KEYS, resolve  # noqa: E402
from mpifl.rundir.names import SUMMARY_CSV  # noqa: E402

# options a sweep owns: the config, the run directory
RESERVED = ("config", "out", "resume")
# options after which mpifl.run prints and exits instead of running a point
NOT_A_RUN = ("show_manifest", "help", "h", "version", "list_presets")
PROG = "python -m mpifl.run"


class SweepError(Exception):
    pass


def parse_value(text: str):
    """A grid value as JSON would have it: 0.1 -> float, 3 -> int, true -> bool, anything else a string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def key_name(text: str) -> str:
    return text.strip().lstrip("-").replace("-", "_")


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def parse_grid(specs: list[str]) -> list[tuple[str, list]]:
    """``["lr=0.01,0.1", "algo=fedavg"]`` -> ``[("lr", [0.01, 0.1]), ("algo", ["fedavg"])]``; a key mpifl has
    no option for, or a value its option cannot take, is refused."""
    grid: list[tuple[str, list]] = []
    known = set(CORE_KEYS) | set(all_options())
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key_name(key)
        if not sep or not key or not values.strip():
            raise SweepError(f"--grid {spec!r}: write KEY=V1,V2,... (e.g. --grid lr=0.01,0.1)")
        if key in RESERVED:
            raise SweepError(f"--grid {key}: the sweep sets --{key} itself")
        if key not in known:
            raise SweepError(f"--grid {key}: mpifl has no option {flag(key)}; see `{PROG} --help` for its options")
        if key in dict(grid):
            raise SweepError(f"--grid {key} is given twice; list all its values in one --grid")
        grid.append((key, [parse_value(v) for v in values.split(",")]))
    for key, values in grid:
        for value in values:
            try:
                resolve({key: value}, {}, all_options())  # mpifl's own types
            except MpiflError as exc:
                raise SweepError(f"--grid {key}: {exc}") from None
    return grid


def expand(grid: list[tuple[str, list]], seeds: list[int] | None = None) -> list[dict]:
    """The cartesian product, first grid outermost, seeds innermost."""
    if seeds:
        if "seed" in dict(grid):
            raise SweepError("give the seeds either as --seeds or as --grid seed=..., not both")
        grid = [*grid, ("seed", seeds)]
    keys = [k for k, _ in grid]
    return [dict(zip(keys, values)) for values in itertools.product(*(v for _, v in grid))]


def point_name(index: int, point: dict) -> str:
    text = "-".join(f"{k}={v}" for k, v in point.items())
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", f"p{index:03d}-{text}" if text else f"p{index:03d}")


def parse_run(args: list[str]) -> click.Context:
    """``args`` as ``python -m mpifl.run`` parses them (unknown options, values of the wrong type: one line)."""
    try:
        return command().make_context(PROG, list(args))
    except click.ClickException as exc:
        raise SweepError(" ".join(exc.format_message().split()).rstrip(".")) from None


def check_common(common: list[str], grid: list[tuple[str, list]], seeds) -> None:
    given = {key_name(a.split("=", 1)[0]) for a in common if a.startswith("-")}
    for key in RESERVED:
        if key in given:
            raise SweepError(f"--{key} among the common options: the sweep sets it for every point")
    for key in NOT_A_RUN:
        if key in given:
            raise SweepError(f"{'-' if len(key) == 1 else '--'}{key.replace('_', '-')} among the common options: "
                             "the points would print and exit instead of running; drop it")
    clash = sorted(given & ({k for k, _ in grid} | ({"seed"} if seeds else set())))
    if clash:
        raise SweepError(f"{', '.join('--' + k for k in clash)} is both swept and a common option; keep one")
    try:
        parse_run(common)
    except SweepError as exc:
        raise SweepError(f"the options after --: {exc}") from None


def run_config(config: Path, run_dir: Path, common: list[str]) -> tuple[dict, list[str]]:
    """The whole configuration ``launch/local.sh --config CONFIG --out RUN_DIR COMMON`` runs, as its
    ``config.json`` will hold it (resolved by mpifl's own command line: defaults, --preset, the file, the flags),
    and mpifl's warnings about it."""
    ctx = parse_run(["--config", str(config), "--out", str(run_dir), *common])
    values = dict(ctx.params)
    config_file = values.pop("config_file")
    values.pop("show_manifest")
    values.pop("resume")
    try:
        cfg, warnings = build_config(ctx, config_file, values)
    except MpiflError as exc:
        raise SweepError(str(exc)) from None
    return json.loads(json.dumps(cfg.to_flat())), warnings


def local_configs(out: Path, names: list[str], points: list[dict], common: list[str]) -> tuple[list[dict], list[str]]:
    """What each point will run (:func:`run_config`), and mpifl's warnings about them, each once; a point mpifl
    would refuse is refused now, before any runs."""
    wanted, warnings = [], {}
    with tempfile.TemporaryDirectory(prefix="mpifl-sweep-") as folder:
        for name, point in zip(names, points):
            path = Path(folder) / f"{name}.json"
            path.write_text(json.dumps(point))
            try:
                cfg, said = run_config(path, out / "runs" / name, common)
            except SweepError as exc:
                raise SweepError(f"point {name}: {exc}; fix --grid or the options after --") from None
            warnings.update(dict.fromkeys(said))
            if cfg["holdout"] == "all":
                raise SweepError(f"point {name}: --holdout all in a --local sweep; sweep the folds instead "
                                 "(--grid holdout=DOMAIN1,DOMAIN2,...), one point each")
            wanted.append(cfg)
    return wanted, list(warnings)


def write_configs(out: Path, points: list[dict]) -> list[Path]:
    """``OUT/configs/<point>.json`` and ``OUT/configs.txt`` (paths relative to it, in point order)."""
    configs = out / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, point in enumerate(points):
        path = configs / f"{point_name(i, point)}.json"
        path.write_text(json.dumps(point, indent=2) + "\n")
        paths.append(path)
    (out / "configs.txt").write_text("".join(f"{p.relative_to(out)}\n" for p in paths))
    return paths


def local_commands(out: Path, paths: list[Path], common: list[str]) -> list[list[str]]:
    return [[str(LOCAL), "--config", str(p), "--out", str(out / "runs" / p.stem), *common] for p in paths]


def slurm_command(out: Path, script: str, n: int, common: list[str], sbatch_args: list[str],
                  max_parallel: int | None) -> tuple[dict, list[str]]:
    """The environment and the sbatch command of the job array."""
    env = {"MPIFL_ARRAY": "config", "MPIFL_CONFIG_LIST": str((out / "configs.txt").resolve()),
           "MPIFL_RUNS": str((out / "runs").resolve()), "MPIFL_ARGS": shlex.join(common)}
    array = f"--array=0-{n - 1}" + (f"%{max_parallel}" if max_parallel else "")
    return env, ["sbatch", "--parsable", array, *sbatch_args, script]


def collect(out: Path, names: list[str], points: list[dict]) -> Path:
    """``OUT/results.csv``: each point's values and its mean test accuracy (last round, best-val round)."""
    keys = list(dict.fromkeys(k for p in points for k in p))
    path = out / "results.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["point", *keys, "model", "last_round", "last_test_acc", "best_round", "best_test_acc"])
        for name, point in zip(names, points):
            summary = out / "runs" / name / SUMMARY_CSV
            rows = list(csv.DictReader(summary.open())) if summary.is_file() else []
            means = [r for r in rows if r["domain"] == "mean"] or [{}]
            for row in means:
                writer.writerow([name, *(point.get(k, "") for k in keys), row.get("model", "missing"),
                                 row.get("last_round", ""), row.get("last_test_acc", ""),
                                 row.get("best_round", ""), row.get("best_test_acc", "")])
    return path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/sweep.py", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --grid KEY=V1,V2 [--grid ...] [--seeds 0,1,2] "
                                      "(--local | --slurm SCRIPT) [--out DIR] [--dry-run] -- [mpifl options]")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="an mpifl option and its values (config key or flag name: lr, local-epochs ...)")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="seeds, comma-separated: every grid point runs once per seed")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true", help="run the points one after another on this machine")
    mode.add_argument("--slurm", metavar="SCRIPT", help="submit one job array of SCRIPT (e.g. slurm/pacs.sh)")
    p.add_argument("--out", type=Path, default=None, help="sweep directory (default runs/sweep-<time>)")
    p.add_argument("--sbatch-args", default="", help="more sbatch options, e.g. \"-p gpu -A project\"")
    p.add_argument("--max-parallel", type=int, default=None, help="Slurm: at most K array tasks at a time")
    p.add_argument("--dry-run", action="store_true", help="write the config files, print the commands, run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, common = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = _parser().parse_args(own)
    out = args.out or Path("runs") / f"sweep-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    try:
        grid = parse_grid(args.grid)
        points = expand(grid, args.seeds)
        check_common(common, grid, args.seeds)
        warnings = []
        if args.local:
            _, warnings = local_configs(out, [point_name(i, p) for i, p in enumerate(points)], points, common)
    except SweepError as exc:
        print(f"sweep: error: {exc}", file=sys.stderr)
        return 2
    for line in warnings:
        print(f"sweep: warning: {line}", file=sys.stderr)
    paths = write_configs(out, points)
    (out / "sweep.json").write_text(json.dumps(
        {"grid": dict(grid), "seeds": args.seeds, "common": common,
         "mode": "local" if args.local else f"slurm {args.slurm}",
         "points": {p.stem: point for p, point in zip(paths, points)}}, indent=2) + "\n")
    print(f"sweep: {len(points)} points, configs in {out / 'configs'} (list: {out / 'configs.txt'})",
          file=sys.stderr)

    if args.slurm:
        env, cmd = slurm_command(out, args.slurm, len(points), common, shlex.split(args.sbatch_args),
                                 args.max_parallel)
        if args.dry_run:
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
            return 0
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"sweep: sbatch failed: {proc.stderr.strip()}", file=sys.stderr)
            return proc.returncode
        job = proc.stdout.strip().split(";")[0]
        (out / "job").write_text(job + "\n")
        print(job)
        print(f"sweep: job array {job}, tasks 0-{len(points) - 1}; runs in {out / 'runs'}", file=sys.stderr)
        return 0

    commands = local_commands(out, paths, common)
    if args.dry_run:
        for cmd in commands:
            print(shlex.join(cmd))
        return 0
    # the runs use this interpreter and this checkout, whatever python is first on PATH
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    failed = []
    for i, (path, cmd) in enumerate(zip(paths, commands), 1):
        if (out / "runs" / path.stem / SUMMARY_CSV).is_file():
            print(f"sweep: [{i}/{len(commands)}] {path.stem}: done already, skipped", file=sys.stderr)
            continue
        print(f"sweep: [{i}/{len(commands)}] {path.stem}", file=sys.stderr, flush=True)
        if subprocess.run(cmd, env=env).returncode != 0:
            failed.append(path.stem)
    results = collect(out, [p.stem for p in paths], points)
    print(f"sweep: results in {results}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
