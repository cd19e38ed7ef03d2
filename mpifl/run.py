"""``python -m mpifl.run``: one federated run over MPI (rank 0 server, ranks 1.. client hosts).

    mpirun -n 3 python -m mpifl.run --algo fedavg --rounds 3

Errors are one line.  A problem every rank sees (a bad option) is printed by
rank 0; a problem found while setting up is gathered and printed once by
rank 0; a failure while training ends the whole job through MPI_Abort from
the failing rank, after that rank printed its one line.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports: a rank failing in them must not leave the others waiting
    from mpi4py import MPI

    from mpifl.job.abort import abort_on_uncaught
    from mpifl.job.faults import maybe_inject
    abort_on_uncaught()
    maybe_inject(rank=MPI.COMM_WORLD.rank, client=-1, round_index=0)

import dataclasses
import datetime
import json
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Callable, TypeVar

import click
import torch
from click.core import ParameterSource

from . import __version__
from .job.abort import abort_job
from .algorithms import ALGORITHMS, all_options, get_algorithm
from .client.normalize import EXCHANGED, stats_spec
from .job.checkpoint import Checkpoint
from .job.checkpoint import load as load_checkpoint
from .transport.mpi import Comm, node_layout
from .plan.config import Option, RunConfig, check, read_config_file, resolve
from .data import KNOWN_DATASETS, default_data_root, default_model, ensure_dataset
from .client.devices import pick_device, threads_for
from .errors import MpiflError
from .client.host import ClientHost
from .server.run_log import MetricsLog, fold_summary
from .models import MODEL_DESCRIPTIONS, MODEL_NAMES
from .presets import apply_preset, describe_presets
from .server.progress import Progress
from .server.server import Server
from .plan.session import make_session, read_labels
from .job.signals import EXIT_STOPPED, StopRequest
from .transport.manifest import format_manifest

T = TypeVar("T")
STOP = StopRequest()  # SIGUSR1/SIGTERM seen by this process (acted upon by rank 0 between rounds)

_HELP = {
    "algo": "federated method: " + "; ".join(f"{n} = {c.summary.split(': ', 1)[-1]}" for n, c in ALGORITHMS.items()),
    "preset": "one experiment of the papers (--list-presets): its dataset, model and hyperparameters, at the "
              "level of a config file (--config and flags override it); --algo picks the method",
    "data": "dataset name (shards under --data-root); styledigits is generated on first use, "
            "others: " + ", ".join(k for k in KNOWN_DATASETS if k != "styledigits"),
    "data_root": "directory holding <data>/<domain>.h5 shards (env MPIFL_DATA_ROOT)",
    "model": "network (auto: the dataset's usual one, digitmodel for styledigits/digits, resnet18 for "
             "PACS/Office-Home/VLCS, alexnet for Office-Caltech/DomainNet): "
             + "; ".join(f"{k} ({v})" for k, v in MODEL_DESCRIPTIONS.items()),
    "pretrained": "local torchvision-format checkpoint to initialise the model from (no download); a classifier "
                  "of another size is skipped; PerXAN models take BN weights on their BN side",
    "rounds": "communication rounds",
    "local_epochs": "local epochs per round (E)",
    "batch_size": "local mini-batch size (B)",
    "lr": "local SGD learning rate",
    "momentum": "local SGD momentum (optimizer state is fresh each round)",
    "weight_decay": "local SGD weight decay",
    "clients_per_domain": "clients per domain (K): 1 = cross-silo; K > 1 splits each domain into K clients",
    "num_clients": "total clients N dealt over the domains in turn (FedWon's sweep; label skew with --dirichlet); "
                   "0 = clients-per-domain x domains",
    "dirichlet": "split each domain among its clients by class proportions drawn from Dir(ALPHA) (label skew); "
                 "0 = even random split",
    "samples_per_client": "keep a seeded subset of S training images per client (equal-size training sets); 0 = all",
    "percent": "keep a seeded fraction P of each client's training images (FedBN's --percent; its 10 Digits-Five "
               "partitions of 743 images: --percent 0.1 is about one, --samples-per-client 743 exactly one)",
    "fraction": "fraction C of clients sampled per round (at least one), seeded",
    "holdout": "leave-one-domain-out: DOMAIN never trains and is evaluated on all its images with the global "
               "model; 'all' runs every fold in turn",
    "aug": "input normalization plug-in for any algorithm: none (dataset normalization), norm (each client's own "
           "channel statistics), fedrdn (FedRDN: statistics drawn from all clients' in training, own at test), "
           "fedrdn-v (all clients' average)",
    "aug_draw": "FedRDN draws: batch (mean and std drawn independently per mini-batch, the authors' code) or "
                "sample (one client's pair per image, the paper's eq. 7)",
    "train_transforms": "training augmentations, in batch on the device: comma list of flip, crop (pad size/8, "
                        "reflect), jitter (brightness/contrast/saturation 0.4), or none",
    "seed": "seed of everything random; results do not depend on the number of ranks",
    "eval_every": "evaluate every N rounds (and after the last)",
    "eval_batch_size": "batch size for evaluation",
    "stream_above": "a client whose images exceed this many GiB streams them from its shard in blocks, read one "
                    "block ahead, instead of keeping them in (device) memory",
    "out": "run directory (default runs/<algo>-<data>-<model>-s<seed>-<time>)",
    "device": "auto (GPU when visible), cpu, or cuda; client ranks bind node-local GPUs round-robin",
    "threads": "torch threads per client rank; 0 = cores on the node / client ranks sharing them",
    "precision": "arithmetic of local training and evaluation: fp32, or bf16/fp16 autocast (weights, gradients "
                 "and aggregation stay fp32; fp16 scales the loss)",
    "channels_last": "store conv weights and images NHWC (faster with tensor cores)",
    "compile": "torch.compile each client rank's feature extractor (minutes of compiling once per rank; pays off "
               "on GPUs over long runs)",
    "gpu_buffers": "where a GPU rank's messages live: auto (on the GPU when the MPI library is CUDA-aware, else "
                   "pinned host memory), pinned, or device (for a CUDA-aware MPI that cannot say so)",
    "ckpt_every": "checkpoint every N rounds and after the last into <out>/checkpoint (0: only when SIGUSR1 or "
                  "SIGTERM stops the run, which always checkpoints)",
    "round_timeout": "fail the job when a rank has not answered for this many seconds (a hang); must exceed the "
                     "longest round; 0 = wait forever",
}

# Options a resumed run may change: how it runs, not what it computes.
RESUMABLE = ("rounds", "data_root", "device", "threads", "eval_batch_size", "stream_above", "ckpt_every",
             "round_timeout", "gpu_buffers")


def _core_options() -> list[click.Option]:
    defaults = RunConfig()
    options = []
    for name, text in _HELP.items():
        default = getattr(defaults, name)
        if name == "data_root":
            default = str(default_data_root())
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            options.append(click.Option([flag], is_flag=True, default=default, help=text))
            continue
        kind = {int: int, float: float}.get(type(default), str)
        options.append(click.Option([flag], type=kind, default=default, show_default=default is not None, help=text))
    return options


def _algo_options() -> list[click.Option]:
    options = []
    for opt in all_options().values():
        defaults = {n: o.default for n, c in ALGORITHMS.items() for o in c.options if o.name == opt.name}
        if len(set(map(repr, defaults.values()))) == 1:
            text = f"{opt.help} [{', '.join(defaults)}; default {opt.default}]"
        else:
            text = f"{opt.help} [default {', '.join(f'{n} {d}' for n, d in defaults.items())}]"
        if opt.type is bool:
            options.append(click.Option([opt.flag], is_flag=True, default=None, help=text))
        else:
            options.append(click.Option([opt.flag], type=opt.type, default=None, help=text))
    return options


def _explicit(ctx: click.Context, values: dict) -> dict:
    """Only the options the user typed: defaults must not override --config."""
    return {k: v for k, v in values.items()
            if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None) and v is not None}


def _build_config(ctx: click.Context, config_file: str | None, values: dict,
                  resume: str | None = None) -> tuple[RunConfig, list[str]]:
    cli_values = _explicit(ctx, values)
    if resume:
        config_file = _resumed_config(resume, config_file, cli_values)
    file_values = read_config_file(config_file) if config_file else {}
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
    if cfg.model == "auto":
        cfg.model = default_model(cfg.data)
    if cfg.model not in MODEL_NAMES:
        raise MpiflError(f"unknown model '{cfg.model}'; choose one of: {', '.join(MODEL_NAMES)}")
    warnings = preset_warnings + [f"{Option(k, object, None, '').flag} has no effect with --algo {cfg.algo}"
                                  for k in foreign]
    return cfg, warnings


def _resumed_config(run_dir: str, config_file: str | None, cli_values: dict) -> Path:
    """``--resume RUN_DIR``: the run's own config.json, which only :data:`RESUMABLE` options may change."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise MpiflError(f"--resume {run_dir}: no config.json there; pass the run directory of an earlier run")
    changed = sorted(k for k in cli_values if k not in RESUMABLE)
    if config_file or changed:
        what = ", ".join(["--config"] * bool(config_file) + [Option(k, object, None, "").flag for k in changed])
        raise MpiflError(f"--resume continues a run with its own configuration; drop {what} (only "
                         f"{', '.join(Option(k, object, None, '').flag for k in RESUMABLE)} may change)")
    cli_values["out"] = str(run_dir)
    return path


def _command() -> click.Command:
    params = _core_options() + _algo_options() + [
        click.Option(["--config", "config_file"], type=str, default=None,
                     help="JSON or YAML file of options (keys as above, - or _); command-line flags override it"),
        click.Option(["--resume", "resume"], type=str, default=None,
                     help="continue RUN_DIR from its checkpoint, in that directory, up to --rounds"),
        click.Option(["--show-manifest"], is_flag=True, default=False,
                     help="print every tensor sent each way with shape, dtype and bytes per round, then exit"),
        click.Option(["--version"], is_flag=True, expose_value=False, is_eager=True,
                     callback=lambda ctx, _, v: v and (click.echo(f"mpifl {__version__}") or ctx.exit()),
                     help="print the version and exit"),
        click.Option(["--list-presets"], is_flag=True, expose_value=False, is_eager=True,
                     callback=lambda ctx, _, v: v and (click.echo(describe_presets()) or ctx.exit()),
                     help="list the experiment presets (--preset): source table, dataset, settings, methods; exit"),
    ]
    return click.Command("mpifl.run", params=params, callback=_main,
                         help="One federated run over MPI: rank 0 is the server, ranks 1.. host the clients. "
                              "Launch with e.g. `mpirun -n 3 python -m mpifl.run --algo fedavg`.",
                         context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})


@click.pass_context
def _main(ctx: click.Context, config_file: str | None, show_manifest: bool, resume: str | None, **values) -> None:
    STOP.install()  # first thing: a stop signal during start-up must not kill a rank
    comm = Comm()
    try:
        cfg, warnings = _build_config(ctx, config_file, values, resume)
        if resume and cfg.holdout == "all":
            raise MpiflError("--resume takes one fold's run directory (<out>/holdout-<domain>), not --holdout all's")
        if comm.rank == 0:
            for warning in warnings:
                _err(f"mpifl: warning: {warning}")
            if show_manifest:
                print(_manifest_text(cfg))
        if not show_manifest and comm.size < 2:
            raise MpiflError("mpifl needs at least 2 MPI ranks (rank 0 is the server, the others host clients); "
                             "launch with e.g. `mpirun -n 3 python -m mpifl.run ...`")
    except MpiflError as exc:  # every rank sees the same configuration: rank 0 speaks for all
        if comm.rank == 0:
            _err(f"mpifl: error: {exc}")
        sys.exit(exc.exit_code)
    if not show_manifest:
        # the server gives up first, so a hung client is named once by it; a hung server is found by
        # client rank 1, whose abort ends the job well before rank 2's clock (3 s later) runs out
        comm.timeout = cfg.round_timeout + 3 * comm.rank if cfg.round_timeout else None
        if cfg.holdout == "all":
            _run_all_folds(cfg, comm)
        else:
            _run(cfg, comm, resume=resume is not None)


def _manifest_text(cfg: RunConfig) -> str:
    manifest = ensure_dataset(cfg.data_root, cfg.data)
    session = make_session(cfg, manifest, num_hosts=1, labels=read_labels(cfg, manifest))
    domains = session.manifest.domains
    setup = [stats_spec(session.manifest.channels)] if cfg.aug in EXCHANGED else []
    setup += [spec for spec in [session.algo.setup_exchange()] if spec is not None]
    return (f"clients: {len(session.clients)} over {len(domains)} domains, {len(session.sampled(1))} per round\n"
            + format_manifest(cfg.algo, session.algo.policy(), len(session.sampled(1)), setup,
                              len(session.training_ids)))


def _run_all_folds(cfg: RunConfig, comm: Comm) -> None:
    """``--holdout all``: one leave-one-domain-out run per domain, in <out>/holdout-<domain>, then a fold table."""
    base = Path(cfg.out) if cfg.out else _default_run_dir(cfg)
    manifest = _collectively(comm, lambda: None, lambda: ensure_dataset(cfg.data_root, cfg.data)
                             if comm.rank == 0 else None)
    domains = comm.comm.bcast(manifest.domains if comm.rank == 0 else None, root=0)  # setup only
    for domain in domains:
        _run(dataclasses.replace(cfg, holdout=domain, out=str(base / f"holdout-{domain}")), comm)
    if comm.rank == 0:
        table = fold_summary({d: base / f"holdout-{d}" for d in domains})
        (base / "summary.md").write_text(table)
        print(table)


def _run(cfg: RunConfig, comm: Comm, resume: bool = False) -> None:
    run_dir: Path | None = Path(cfg.out) if resume else None

    def setup_dataset():
        nonlocal run_dir
        if comm.rank == 0:
            run_dir = _resume_run_dir(cfg) if resume else _make_run_dir(cfg)
            return read_labels(cfg, ensure_dataset(cfg.data_root, cfg.data))
        return None

    labels = _collectively(comm, lambda: run_dir, setup_dataset)
    # setup only, a few small objects: the run directory, and the labels a Dirichlet split needs
    run_dir, labels = comm.comm.bcast((str(run_dir) if run_dir else None, labels), root=0)
    run_dir = Path(run_dir)
    layout = node_layout(comm.comm)

    def setup_ranks():
        session = make_session(cfg, ensure_dataset(cfg.data_root, cfg.data), num_hosts=comm.size - 1,
                               labels=labels)
        resumed = load_checkpoint(run_dir, cfg, len(session.clients)) if resume else None
        if resumed and resumed.round >= cfg.rounds:
            raise MpiflError(f"{run_dir} is checkpointed after round {resumed.round}; pass --rounds above "
                             f"{resumed.round} to continue it")
        if comm.rank == 0:
            torch.set_num_threads(1)
            return session, None, resumed
        torch.set_num_threads(threads_for(layout, cfg.threads))
        return session, ClientHost(session, comm, pick_device(cfg.device, layout), run_dir, resumed), resumed

    session, host, resumed = _collectively(comm, lambda: run_dir, setup_ranks)
    # setup only: where each rank runs, so the log maps a launcher's "PID ... EXIT CODE: 9" to a rank
    processes = comm.comm.gather(f"pid {os.getpid()} on {socket.gethostname()}, {torch.get_num_threads()} threads"
                                 + (f", {host.placement_note()}" if host else ""), root=0)
    try:
        if comm.rank == 0:
            stopped_by = _serve(cfg, comm, session, run_dir, resumed, STOP, processes)
        else:
            host.run()
            stopped_by = host.stopped
    except MpiflError as exc:
        abort_job(f"mpifl: error: {exc}", exc.exit_code)
    except Exception as exc:  # a bug: one line here, the traceback in the run directory
        abort_job(_crash_line(comm.rank, exc, run_dir), 1)
    if stopped_by:
        sys.exit(EXIT_STOPPED)


def _resume_run_dir(cfg: RunConfig) -> Path:
    path = Path(cfg.out)
    (path / "config.json").write_text(json.dumps(cfg.to_flat(), indent=2) + "\n")  # the new --rounds etc.
    return path


def _serve(cfg: RunConfig, comm: Comm, session, run_dir: Path, resumed: Checkpoint | None,
           stop: StopRequest, processes: list[str]) -> str | None:
    """Rank 0's part of the run; returns the signal that stopped it early, if one did."""
    n_clients, n_hosts = len(session.clients), comm.size - 1
    log_lines = [f"mpifl {__version__}: {cfg.algo} on {cfg.data} ({n_clients} clients, "
                 f"{len(session.manifest.domains)} domains) with {cfg.model}, {cfg.rounds} rounds, "
                 f"{n_hosts} client ranks; run directory {run_dir}"]
    if resumed:
        log_lines.append(f"resuming after round {resumed.round} from {run_dir / 'checkpoint'}"
                         + ("" if len(resumed.ranks) == n_hosts else
                            f"; its clients were on {len(resumed.ranks)} client ranks, now placed on {n_hosts}"))
    if n_hosts > n_clients:
        log_lines.append(f"mpifl: warning: {n_hosts} client ranks for {n_clients} clients; "
                         f"ranks {n_clients + 1}..{n_hosts} stay idle (use mpirun -n {n_clients + 1})")
    log_lines.append(f"rank 0 ({processes[0]}): server")
    log_lines += [f"rank {h + 1} ({processes[h + 1]}): clients {ids}" for h, ids in enumerate(session.placement)]
    if session.pretrained:
        log_lines.append(session.pretrained.summary())
    log_path = run_dir / "log.txt"
    with log_path.open("a") as log_file:
        for line in log_lines:
            (_err if line.startswith("mpifl: warning") else print)(line)
            log_file.write(line + "\n")
        log_file.flush()  # a job killed later still leaves who ran where
        progress = Progress(cfg.rounds)
        metrics = MetricsLog(run_dir, session.algo.evaluates, session.source_domains, cfg.holdout)
        if resumed:
            metrics.resume(resumed.round, resumed.pending, evaluated=Server.evaluates_round(cfg, resumed.round))

        def on_round(r: int, acc: float | None) -> None:
            progress.update(r, acc)
            log_file.write(f"round {r}: mean test acc {acc}\n")
            log_file.flush()

        server = Server(session, comm, metrics, on_round, run_dir, resumed, stop)
        server.run()
        if server.stopped_by:
            line = (f"mpifl: stopped by {server.stopped_by} after round {server.stopped_after}; checkpoint in "
                    f"{run_dir / 'checkpoint'}; continue with --resume {run_dir}")
            _err(line)
            log_file.write(line + "\n")
            return server.stopped_by
        metrics.write_summary()
        summary = (run_dir / "summary.md").read_text()
        print(summary)
        log_file.write(summary)
    return None


def _make_run_dir(cfg: RunConfig) -> Path:
    if cfg.out:
        path = Path(cfg.out)
        if (path / "metrics.jsonl").exists():
            raise MpiflError(f"run directory {path} already holds a run; pass another --out or remove it")
    else:
        path = _default_run_dir(cfg)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_flat(), indent=2) + "\n")
    return path


def _default_run_dir(cfg: RunConfig) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = path = Path("runs") / f"{cfg.algo}-{cfg.data}-{cfg.model}-s{cfg.seed}-{stamp}"
    suffix = 1
    while path.exists():
        path = base.with_name(f"{base.name}_{suffix}")
        suffix += 1
    return path


def _collectively(comm: Comm, run_dir: Callable[[], Path | None], step: Callable[[], T]) -> T:
    """Run a setup step on every rank; if any rank failed, rank 0 prints the first failure once and all exit."""
    error = None
    result = None
    try:
        result = step()
    except MpiflError as exc:
        error = (str(exc), exc.exit_code)
    except Exception as exc:
        error = (_crash_line(comm.rank, exc, run_dir()), 1)
    comm.arrive("the other ranks to finish setting up")
    errors = comm.comm.allgather(error)  # setup only: a few short strings
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        rank, (message, code) = failed[0]
        if comm.rank == 0:
            where = f" (rank {rank})" if rank and not message.startswith("mpifl: rank") else ""
            _err(message if message.startswith("mpifl: ") else f"mpifl: error: {message}{where}")
        sys.exit(code)
    return result


def _crash_line(rank: int, exc: BaseException, run_dir: Path | None) -> str:
    text = "".join(traceback.format_exception(exc))
    where = "above"
    if run_dir is not None:
        path = run_dir / f"traceback-rank{rank}.txt"
        path.write_text(text)
        where = f"in {path}"
    else:
        sys.stderr.write(text)
    return f"mpifl: rank {rank} failed: {type(exc).__name__}: {exc} (traceback {where})"


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


main = _command()

if __name__ == "__main__":
    main()
