"""The command line of ``python -m mpifl.run``: its options (every run's, :data:`~mpifl.plan.config.RUN_OPTIONS`,
and every method's own), how they merge with ``--config``, ``--preset`` and ``--resume`` into one
:class:`RunConfig`, and ``--show-manifest``.

What a parsed command then does on every rank is :mod:`mpifl.job.start`'s.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path
from typing import Sequence

import click
from click.core import ParameterSource

from .. import __version__
from ..algorithms import ALGORITHMS, all_options, get_algorithm
from ..data import KNOWN_DATASETS, default_data_root, default_model
from ..errors import MpiflError
from ..models import MODEL_DESCRIPTIONS, MODEL_NAMES
from ..plan.config import (CORE_KEYS, RESUMABLE, RUN_OPTIONS, Option, RunConfig, check, check_acting, coerce,
                           read_config_file, resolve, resumable)
from ..plan.normalize import resolve_input_norm
from ..presets import apply_preset, describe_presets
from ..rundir.directory import resumed_config


def _core_options(options: tuple[Option, ...]) -> list[click.Option]:
    """A flag per run option; its help names what lies above mpifl.plan (the methods, datasets and models)."""
    names = {"methods": "; ".join(f"{n} = {c.summary.split(': ', 1)[-1]}" for n, c in ALGORITHMS.items()),
             "fresh_optimizer": ", ".join(n for n, c in ALGORITHMS.items() if c.fresh_optimizer),
             "datasets": ", ".join(k for k in KNOWN_DATASETS if k != "styledigits"),
             "models": "; ".join(f"{k} ({v})" for k, v in MODEL_DESCRIPTIONS.items())}
    return [_click_option(o, str(default_data_root()) if o.name == "data_root" else o.default, o.help.format(**names))
            for o in options]


def _algo_options() -> list[click.Option]:
    """A flag per method option, its help naming the methods that take it and their defaults."""
    options = []
    for opt in all_options().values():
        defaults = {n: o.default for n, c in ALGORITHMS.items() for o in c.options if o.name == opt.name}
        options.append(_click_option(opt, None, f"{opt.help} [{_defaults_text(defaults)}]"))
    return options


def _defaults_text(defaults: dict) -> str:
    """The methods taking an option and their defaults: one list per default; an option every method takes
    (``--guide-lambda``) names only the methods whose default is not the most common."""
    values = list(map(repr, defaults.values()))
    if len(set(values)) == 1:
        return f"{', '.join(defaults)}; default {next(iter(defaults.values()))}"
    if len(defaults) == len(ALGORITHMS):
        common = max(set(values), key=values.count)
        usual = next(d for d in defaults.values() if repr(d) == common)
        others = ", ".join(f"{n} {d}" for n, d in defaults.items() if repr(d) != common)
        return f"every method; default {usual}, {others}"
    return f"default {', '.join(f'{n} {d}' for n, d in defaults.items())}"


def _click_option(opt: Option, default, text: str) -> click.Option:
    """``opt``'s flag: one without a value for a bool option, else one taking a value of its type."""
    if opt.type is bool:
        return click.Option([opt.flag], is_flag=True, default=default, help=text)
    return click.Option([opt.flag], type=opt.type, default=default, show_default=default is not None, help=text)


def _explicit(ctx: click.Context, values: dict) -> dict:
    """Only the options the user typed: defaults must not override --config."""
    return {k: v for k, v in values.items()
            if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None) and v is not None}


def build_config(ctx: click.Context, config_file: str | None, values: dict,
                  resume: str | None = None) -> tuple[RunConfig, list[str]]:
    cli_values = _explicit(ctx, values)
    if resume:
        config_file = _resumed_config(resume, config_file, cli_values)
    file_values = read_config_file(config_file) if config_file else {}
    given = {**({} if resume else file_values), **cli_values}  # the user's own: no preset's, no resumed run's
    algo_name = cli_values.get("algo", file_values.get("algo", RunConfig.algo))
    file_values, preset_warnings = apply_preset(cli_values.get("preset", file_values.get("preset")), algo_name,
                                                file_values)
    algo_cls = get_algorithm(algo_name)
    declared = {o.name: o for o in algo_cls.options}
    foreign = sorted(k for k in {**file_values, **cli_values} if k in all_options() and k not in declared)
    merged_file = {k: v for k, v in file_values.items() if k not in foreign}
    merged_cli = {k: v for k, v in cli_values.items() if k not in foreign}
    cfg = resolve(merged_file, merged_cli, declared)
    if "data_root" not in merged_cli and "data_root" not in merged_file:
        cfg.data_root = str(default_data_root())
    check(cfg)
    check_acting(cfg, given)
    algo_cls.check_options(cfg)
    cfg.schedule_rounds = cfg.horizon  # stored in config.json: a resume with other --rounds keeps the schedules
    cfg.input_norm = resolve_input_norm(cfg.input_norm, cfg.pretrained)
    if cfg.model == "auto":
        cfg.model = default_model(cfg.data)
    if cfg.model not in MODEL_NAMES:
        raise MpiflError(f"unknown model '{cfg.model}'; choose one of: {', '.join(MODEL_NAMES)}")
    warnings = preset_warnings + [f"{Option(k, object, None, '').flag} has no effect with --algo {cfg.algo}"
                                  for k in foreign]
    return cfg, warnings


def usage_line(exc: click.ClickException) -> str:
    """Click's message of a usage error as one line, without its closing full stop."""
    return " ".join(exc.format_message().split()).rstrip(".")


def configuration(args: Sequence[str]) -> tuple[RunConfig, list[str]]:
    """What ``python -m mpifl.run ARGS`` would run, and its warnings, without running it (the launch scripts and the
    benchmark check their runs so): a usage error raises click's exception, a refused option :class:`MpiflError`."""
    ctx = command().make_context("python -m mpifl.run", list(args))
    values = dict(ctx.params)
    config_file, resume = values.pop("config_file"), values.pop("resume")
    del values["show_manifest"]
    return build_config(ctx, config_file, values, resume)


def _resumed_config(run_dir: str, config_file: str | None, cli_values: dict) -> Path:
    """``--resume RUN_DIR``: the run's own config.json, which only :data:`RESUMABLE` options may change.

    Options given again (on the command line or in ``--config``) with the values the run has are accepted, so
    the command that started a run, plus ``--resume``, continues it; a real change is refused, named."""
    path = resumed_config(Path(run_dir))
    stored = read_config_file(path)
    given = {**(read_config_file(config_file) if config_file else {}), **cli_values}
    unknown = sorted(k for k in given if k not in CORE_KEYS and k not in all_options())
    if unknown:
        raise MpiflError(f"unknown option(s) {', '.join(unknown)}; see `python -m mpifl.run --help` for valid names")
    changed = [k for k in given if k not in RESUMABLE and _differs(k, given[k], stored, run_dir)]
    if changed:
        what = ", ".join(f"{_flag(k)} {given[k]} (the run has {stored.get(k)})" for k in changed)
        raise MpiflError(f"--resume continues {run_dir} with its own configuration, and this command changes "
                         f"{what}; drop or correct them (only {', '.join(map(_flag, RESUMABLE))} may change)")
    for key in given:
        if key not in RESUMABLE:
            cli_values.pop(key, None)
    cli_values["out"] = str(run_dir)
    return path


def _differs(key: str, value, stored: dict, run_dir: str) -> bool:
    """Whether an option given again with ``--resume`` changes the run's stored value."""
    if key == "out":
        return Path(value).resolve() != Path(run_dir).resolve()
    if key not in stored:  # an option of another method: it had no effect, and has none now
        return key in CORE_KEYS
    if key == "model" and value == "auto":
        value = default_model(stored.get("data", RunConfig.data))
    if stored[key] is None or value is None:
        return stored[key] != value
    return coerce(key, value, type(stored[key])) != stored[key]


def _flag(key: str) -> str:
    return Option(key, object, None, "").flag


def command(options: tuple[Option, ...] = RUN_OPTIONS) -> click.Command:
    """``python -m mpifl.run``: a flag per run option (``options``), per method option, and the command's own."""
    params = _core_options(options) + _algo_options() + [
        click.Option(["--config", "config_file"], type=str, default=None,
                     help="JSON or YAML file of options (keys as above, - or _); command-line flags override it"),
        click.Option(["--resume", "resume"], type=str, default=None,
                     help="continue RUN_DIR from its checkpoint, in that directory, up to --rounds, with its own "
                          "config.json: only " + ", ".join(map(_flag, resumable(options))) + " may change (options "
                          "given again with the run's values are accepted; a real change is refused, named)"),
        click.Option(["--show-manifest"], is_flag=True, default=False,
                     help="print every tensor sent each way with shape, dtype and bytes per client and round, the "
                          "one-time exchanges, and 'data-derived' on each computed from the clients' data (under "
                          "--holdout all each fold's), then exit"),
        click.Option(["--version"], is_flag=True, expose_value=False, is_eager=True,
                     callback=lambda ctx, _, v: v and (click.echo(f"mpifl {__version__}") or ctx.exit()),
                     help="print the version and exit"),
        click.Option(["--list-presets"], is_flag=True, expose_value=False, is_eager=True,
                     callback=lambda ctx, _, v: v and (click.echo(describe_presets()) or ctx.exit()),
                     help="list the experiment presets (--preset): source table, dataset, settings, methods; exit"),
    ]
    return click.Command("mpifl.run", params=params, callback=_main,
                         help="One federated run over MPI: rank 0 is the server, ranks 1.. host the clients. "
                              "Launch with e.g. `mpirun -n 3 python -m mpifl.run --algo fedavg`; started without "
                              "a launcher, the server and one client host run in this process.",
                         context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})


def invoke(cmd: click.Command, args: list[str] | None = None, rank: int = 0) -> None:
    """Parse ``args`` (default: the process's) and run the command.  Under a launcher every rank parses the
    same command line: only rank 0 prints what parsing prints (``--help``, ``--version``, ``--list-presets``)
    and a usage error, as one line; every rank exits with the same code."""
    args = sys.argv[1:] if args is None else list(args)
    try:
        with contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext():
            ctx = cmd.make_context("python -m mpifl.run", args)
    except click.exceptions.Exit as done:  # --help and the like, printed
        sys.exit(done.exit_code)
    except click.ClickException as exc:
        if rank == 0:
            sys.stderr.write(f"mpifl: error: {usage_line(exc)}; see `python -m mpifl.run --help`\n")
        sys.exit(exc.exit_code)
    with ctx:
        cmd.invoke(ctx)


@click.pass_context
def _main(ctx: click.Context, config_file: str | None, show_manifest: bool, resume: str | None, **values) -> None:
    from .start import start  # the runtime, imported once the command line is known to be sound

    start(lambda: build_config(ctx, config_file, values, resume), show_manifest, resume)
