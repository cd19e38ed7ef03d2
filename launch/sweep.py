#!/usr/bin/env python3
"""A grid of mpifl configurations, run one after another here or as one Slurm job array.

    python launch/sweep.py --grid lr=0.01,0.1 --grid algo=fedavg,fedbn --seeds 0,1,2 --local -- --rounds 50
    python launch/sweep.py --grid lr=0.01,0.1 --grid algo=fedavg,fedbn --slurm slurm/pacs.sh -- --rounds 50
    python launch/sweep.py ... --dry-run          # write the config files, print the commands, run nothing

The cartesian product of the ``--grid KEY=V1,V2,...`` lists (first grid outermost) and of ``--seeds``
(innermost) gives the points.  Each point becomes a JSON file of the keys ``python -m mpifl.run --config``
reads, in ``OUT/configs/``; ``OUT/configs.txt`` lists them, one a line, in point order.  Options after
``--`` are common to every point and go on each run's command line (they must not repeat a grid key).

``--local`` runs the points in order through ``launch/local.sh`` into ``OUT/runs/<point>`` and collects
every run's mean test accuracy into ``OUT/results.csv``.  Running the same command again continues the sweep:
a point whose run finished is skipped, one stopped with a checkpoint is resumed (``--resume``), one that ended
without a checkpoint is reported and not run again (move its directory away to run it again).  A point's run
counts only if its ``config.json`` is the whole configuration the point asks now (grid values and options
after ``--`` resolved as ``python -m mpifl.run`` resolves them, defaults and ``--preset`` included); a run of
another configuration is refused before anything starts, so ``results.csv`` never mixes them.

``--slurm SCRIPT`` submits ``sbatch --array=0-(N-1) SCRIPT`` once: task i runs point i (the script reads
``MPIFL_CONFIG_LIST``), into ``OUT/runs/<job name>-<array job>_<i>-<point>``; ``--sbatch-args`` adds
options (``"-p gpu -A project"``), ``--max-parallel K`` runs at most K tasks at a time; ``OUT/job`` lists
the array jobs submitted, one a line.

A sweep folder holds one sweep: ``OUT/sweep.json`` records its grid, seeds, options after ``--`` and mode,
and a command with other ones (``--dry-run`` included) is refused in one line, before anything is written;
so is a folder that holds files but no ``sweep.json``.  Grid keys and the options after ``--`` are checked
against mpifl's own options once, before any point starts.
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
from mpifl.job.cli import command, configuration, usage_line  # noqa: E402
from mpifl.plan.config import CORE_KEYS, resolve  # noqa: E402
from mpifl.rundir.checkpoint import committed_round  # noqa: E402
from mpifl.rundir.names import CONFIG, LOG, SUMMARY_CSV  # noqa: E402

# options a sweep owns: the config, the run directory
RESERVED = ("config", "out", "resume")
# options after which mpifl.run prints and exits instead of running a point
NOT_A_RUN = ("show_manifest", "help", "h", "version", "list_presets")
SWEEP = "sweep.json"  # the sweep a folder holds: its grid, seeds, options after -- and mode
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
        raise SweepError(usage_line(exc)) from None


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
    try:
        cfg, warnings = configuration(["--config", str(config), "--out", str(run_dir), *common])
    except click.ClickException as exc:
        raise SweepError(usage_line(exc)) from None
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


def record(grid, seeds, common: list[str], mode: str, names: list[str], points: list[dict]) -> dict:
    """``sweep.json``: what makes the sweep this one (grid, seeds, common options, mode) and its points."""
    return json.loads(json.dumps({"grid": dict(grid), "seeds": seeds, "common": common, "mode": mode,
                                  "points": dict(zip(names, points))}))


def _differences(held: dict, asked: dict) -> str:
    """What makes the sweep a folder holds another than the one asked, in a few words."""
    shown = {"grid": lambda g: " ".join(f"{k}={','.join(map(str, v))}" for k, v in (g or {}).items()),
             "seeds": lambda s: ",".join(map(str, s or [])), "common": lambda c: shlex.join(c or []),
             "mode": lambda m: m or ""}
    names = {"grid": "--grid", "seeds": "--seeds", "common": "options after --", "mode": "mode"}
    said = [f"{names[k]} {shown[k](held.get(k)) or 'none'!r}, not {shown[k](asked[k]) or 'none'!r}"
            for k in shown if held.get(k) != asked[k]]
    return "; ".join(said) or "other points"


def check_folder(out: Path, asked: dict) -> None:
    """``OUT`` may take this sweep: it is new, empty, or holds this very sweep (the same ``sweep.json``: a sweep
    continued); anything else is refused, before anything is written."""
    if out.exists() and not out.is_dir():
        raise SweepError(f"--out {out} is a file; pass a folder for the sweep")
    path = out / SWEEP
    if path.is_file():
        try:
            held = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SweepError(f"{path} is unreadable ({exc}); pass another --out") from None
        if held != asked:
            raise SweepError(f"{out} holds another sweep ({_differences(held, asked)}); a sweep folder holds one "
                             "sweep, its results stay as they are: pass another --out")
    elif out.is_dir() and any(out.iterdir()):
        raise SweepError(f"{out} holds files but no {SWEEP}: it is no sweep folder; pass a new or empty --out")


def point_state(run_dir: Path, wanted: dict) -> str:
    """What a point's run directory holds: ``new`` (no run yet), ``done`` (a finished run of the point's
    configuration), ``resume`` (one stopped with a checkpoint), ``ended`` (one stopped without: it cannot be
    continued); a run of another configuration than the point asks is refused."""
    try:
        held = json.loads((run_dir / CONFIG).read_text())
    except FileNotFoundError:
        return "new"  # nothing, or no run's configuration: mpifl.run decides whether it may run there
    except (OSError, ValueError) as exc:
        raise SweepError(f"{run_dir / CONFIG} is unreadable ({exc}); move {run_dir} away") from None
    differ = sorted(k for k in set(held) | set(wanted) if k != "out" and held.get(k, "unset") != wanted.get(k, "unset"))
    if differ:
        def options(cfg):
            return " ".join(f"{flag(k)} {cfg.get(k, 'unset')}" for k in differ)
        raise SweepError(f"{run_dir} was run with another configuration than its point asks now (it has "
                         f"{options(held)}; the point asks {options(wanted)}); its results stay as they are: pass "
                         "another --out, or the options that run had")
    if (run_dir / SUMMARY_CSV).is_file():
        return "done"
    return "resume" if committed_round(run_dir) is not None else "ended"


def _write(path: Path, text: str) -> None:
    """``text`` into ``path``, atomically, unless it holds it already (a task may be reading it)."""
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def claim(out: Path, asked: dict) -> None:
    """Write ``sweep.json`` unless the folder has it; of two sweeps started at once into one folder, the second
    finds the first's and is refused (:func:`check_folder`)."""
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{SWEEP}.", dir=out)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asked, indent=2) + "\n")
        os.link(tmp, out / SWEEP)
    except FileExistsError:
        check_folder(out, asked)
    finally:
        os.unlink(tmp)


def write_configs(out: Path, names: list[str], points: list[dict]) -> list[Path]:
    """``OUT/configs/<point>.json`` and ``OUT/configs.txt`` (paths relative to it, in point order)."""
    configs = out / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, point in zip(names, points):
        path = configs / f"{name}.json"
        _write(path, json.dumps(point, indent=2) + "\n")
        paths.append(path)
    _write(out / "configs.txt", "".join(f"{p.relative_to(out)}\n" for p in paths))
    return paths


def local_command(out: Path, path: Path, common: list[str], state: str) -> list[str]:
    run_dir = str(out / "runs" / path.stem)
    where = ["--resume", run_dir] if state == "resume" else ["--out", run_dir]
    return [str(LOCAL), "--config", str(path), *where, *common]


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
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
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
    os.replace(tmp, path)
    return path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/sweep.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]).replace("``", ""),
                                usage="%(prog)s --grid KEY=V1,V2 [--grid ...] [--seeds 0,1,2] "
                                      "(--local | --slurm SCRIPT) [--out DIR] [--dry-run] -- [mpifl options]")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="an mpifl option and its values (config key or flag name: lr, local-epochs ...)")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="seeds, comma-separated: every grid point runs once per seed")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", action="store_true", help="run the points one after another on this machine")
    mode.add_argument("--slurm", metavar="SCRIPT", help="submit one job array of SCRIPT (e.g. slurm/pacs.sh)")
    p.add_argument("--out", type=Path, default=None,
                   help="sweep directory (default runs/sweep-<time>): a new or empty one, or this sweep's own to "
                        "continue it; another sweep's is refused")
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
        names = [point_name(i, point) for i, point in enumerate(points)]
        asked = record(grid, args.seeds, common, "local" if args.local else f"slurm {args.slurm}", names, points)
        check_folder(out, asked)
        states, warnings = [], []
        if args.local:
            wanted, warnings = local_configs(out, names, points, common)
            states = [point_state(out / "runs" / name, cfg) for name, cfg in zip(names, wanted)]
        claim(out, asked)
    except SweepError as exc:
        print(f"sweep: error: {exc}", file=sys.stderr)
        return 2
    for line in warnings:
        print(f"sweep: warning: {line}", file=sys.stderr)
    paths = write_configs(out, names, points)
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
        with (out / "job").open("a") as f:  # every submission of this sweep, one a line
            f.write(job + "\n")
        print(job)
        print(f"sweep: job array {job}, tasks 0-{len(points) - 1}; runs in {out / 'runs'}", file=sys.stderr)
        return 0

    commands = [local_command(out, path, common, state) for path, state in zip(paths, states)]
    if args.dry_run:
        for path, cmd, state in zip(paths, commands, states):
            if state in ("new", "resume"):
                print(shlex.join(cmd))
            else:
                print(f"sweep: {path.stem}: {'done already' if state == 'done' else 'ended'}, not run",
                      file=sys.stderr)
        return 0
    # the runs use this interpreter and this checkout, whatever python is first on PATH
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    failed = []
    for i, (path, cmd, state) in enumerate(zip(paths, commands, states), 1):
        run_dir = out / "runs" / path.stem
        head = f"sweep: [{i}/{len(commands)}] {path.stem}"
        if state == "done":
            print(f"{head}: done already, skipped", file=sys.stderr)
            continue
        if state == "ended":
            print(f"{head}: {run_dir} holds a run that stopped without results or a checkpoint (its {LOG} says "
                  "why); not run again: move it away to run the point anew", file=sys.stderr)
            failed.append(path.stem)
            continue
        more = f": continued from its checkpoint (round {committed_round(run_dir)})" if state == "resume" else ""
        print(head + more, file=sys.stderr, flush=True)
        if subprocess.run(cmd, env=env).returncode != 0:
            failed.append(path.stem)
    results = collect(out, [p.stem for p in paths], points)
    print(f"sweep: results in {results}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
