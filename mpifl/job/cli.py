"""The command line of ``python -m mpifl.run``: its options (core ones, and every method's own), how they
merge with ``--config``, ``--preset`` and ``--resume`` into one :class:`RunConfig`, and ``--show-manifest``.

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
from ..plan.config import (CORE_KEYS, RESUMABLE, Option, RunConfig, check, check_acting, coerce, read_config_file,
                           resolve)
from ..plan.normalize import resolve_input_norm
from ..presets import apply_preset, describe_presets
from ..rundir.directory import resumed_config

_HELP = {
    "algo": "federated method: " + "; ".join(f"{n} = {c.summary.split(': ', 1)[-1]}" for n, c in ALGORITHMS.items()),
    "preset": "one experiment of the papers (--list-presets): its dataset, model and hyperparameters, at the "
              "level of a config file (--config and flags override it); --algo picks the method",
    "data": "dataset name (shards under --data-root); styledigits is generated on first use, "
            "others: " + ", ".join(k for k in KNOWN_DATASETS if k != "styledigits"),
    "data_root": "directory holding <data>/<domain>.h5 shards (env MPIFL_DATA_ROOT)",
    "model": "network (auto: the dataset's usual one, digitmodel for styledigits/digits, resnet18 for "
             "PACS/Office-Home/VLCS, alexnet for Office-Caltech/DomainNet): "
             + "; ".join(f"{k} ({v})" for k, v in MODEL_DESCRIPTIONS.items())
             + "; each is built with the normalization and conv kind its method asks for",
    "norm": "normalization layers: auto (the method's own: bn for most, perxan gperxan, jsbn fedstein, agn "
            "fednn, none fedwon, gn/ln fedavg-gn/-ln), or one of bn, gn, ln, in, none, perxan, agn, jsbn, ibn "
            "(IBN-Net's IBN-a: IN on half the channels, BN on the rest; DenseNet: IN on the last 40 %), dson "
            "(DSON: learned mix of BN and IN statistics, every entry a BN side); a method whose rule needs its own "
            "kind refuses the others",
    "norm_blocks": "where perxan, ibn and dson layers go, plain shared BN elsewhere: auto (all for perxan and "
                   "dson, every stage but the last for ibn, at IBN-Net's sites per architecture: ResNet block bn1, "
                   "every third DenseNet norm1, MobileNetV2 each block's first norm, plain CNNs and U-Net every conv "
                   "norm; the stem stays BN), all, N (the stem and the first N stages) or N-nostem (those stages "
                   "without the stem); gperxan's --perxan-blocks is the same",
    "pretrained": "local torchvision-format checkpoint to initialise the model from (no download); a classifier "
                  "of another size is skipped; PerXAN models take BN weights on their BN side; inputs are "
                  "then normalized with ImageNet's mean and std (--input-norm auto)",
    "rounds": "communication rounds",
    "local_epochs": "local epochs per round (E)",
    "batch_size": "local mini-batch size (B)",
    "lr": "local learning rate (of round 1, before --lr-schedule)",
    "momentum": "local SGD momentum (--optimizer sgd; the buffers are fresh each round unless --keep-optimizer)",
    "weight_decay": "local weight decay (an L2 term in the gradient)",
    "seg_loss": "training loss of a segmentation dataset, one for every method of a run: dice (softmax over all "
                "classes, background included; FedRDN's paper), dice-ce, (CE + Dice) / 2 (the HarmoFL and FedFA "
                "prostate code), or sigmoid-dice (ELCFS's code: a sigmoid head of the foreground classes only, Dice "
                "averaged over them, no CE; a pixel is foreground above 0.75); the Dice score counts every class "
                "whatever the loss; a classification dataset trains with cross-entropy",
    "optimizer": "local optimizer: sgd, or adam (betas 0.9, 0.999; FedRDN's segmentation setting: --lr 1e-3 "
                 "--weight-decay 1e-4; --momentum is refused with it)",
    "lr_schedule": "learning rate of round r = 1..R (R: --schedule-rounds): none (--lr), exp (lr gamma^(r-1); "
                   "FedNN: gamma 0.998), step (lr gamma^floor((r-1)/--lr-step)), or cosine (lr_min + (lr - lr_min)"
                   "(1 + cos(pi r/R))/2, gPerXAN's code: round R trains at --lr-min, later rounds too)",
    "lr_gamma": "decay factor of --lr-schedule exp and step",
    "lr_step": "rounds between two decays of --lr-schedule step",
    "lr_min": "learning rate --lr-schedule cosine reaches in round R",
    "schedule_rounds": "R, the rounds that schedules over the run span (--lr-schedule cosine, FixBN's default "
                       "switch, FedNN's temperature); 0 = --rounds. Stored in config.json: a run resumed with more "
                       "--rounds keeps them (each schedule stays at its round-R value after R)",
    "max_grad_norm": "clip every local step's gradient to this L2 norm over all parameters, after the method's "
                     "corrections (FedNN's code: 10, for every method); 0 = off",
    "keep_optimizer": "keep each client's optimizer state (SGD momentum; Adam moments and steps) from one of its "
                      "rounds to its next, as gPerXAN's code and FixBN's paper do: private state, checkpointed, never "
                      "sent (default: a fresh optimizer each round; refused by the methods whose rule assumes one: "
                      + ", ".join(n for n, c in ALGORITHMS.items() if c.fresh_optimizer) + ")",
    "clients_per_domain": "clients per domain (K): 1 = cross-silo; K > 1 splits each domain into K clients",
    "num_clients": "total clients N dealt over the domains in turn (FedWon's sweep; label skew with --dirichlet); "
                   "0 = clients-per-domain x domains",
    "dirichlet": "split each domain among its clients by class proportions drawn from Dir(ALPHA) (label skew), "
                 "the same proportions for train, val and test; 0 = even random split",
    "samples_per_client": "keep a seeded subset of S training images per client (equal-size training sets); 0 = all",
    "percent": "keep a seeded fraction P of each client's training images (FedBN's --percent; its 10 Digits-Five "
               "partitions of 743 images: --percent 0.1 is about one, --samples-per-client 743 exactly one)",
    "fraction": "fraction C of clients sampled per round (at least one), seeded",
    "holdout": "leave-one-domain-out: DOMAIN never trains and is evaluated on all its images with the global "
               "model; 'all' runs every fold in turn into <out>/holdout-<domain> and writes a fold table to "
               "<out>/summary.md",
    "input_norm": "input normalization with --aug none: auto (the default: imagenet with --pretrained, else "
                  "pooled; config.json stores the mode it resolves to), pooled (mean/std over the train images of "
                  "every domain in the dataset build), domain (each domain's own train mean/std, a held-out "
                  "domain's too), fixed (the dataset's reference-code constants: 0.5/0.5 Digits-Five, 0/1 "
                  "Office-Caltech-10 and DomainNet-10, as FedBN's code; mean 0, std 1/255 on prostate, the "
                  "unscaled 0..255 of FedFA's and HarmoFL's loaders) or imagenet (ImageNet mean/std, for "
                  "pre-trained backbones)",
    "aug": "input normalization plug-in for any algorithm: none (dataset normalization), norm (each client's own "
           "channel statistics), fedrdn (FedRDN: statistics drawn from all clients' in training, own at test), "
           "fedrdn-v (all clients' average)",
    "aug_draw": "FedRDN draws: batch (mean and std drawn independently per mini-batch, the authors' code) or "
                "sample (one client's pair per image, the paper's eq. 7)",
    "aug_stats": "images a client's own statistics (--aug norm/fedrdn/fedrdn-v) are computed on: augmented (one "
                 "pass through --train-transforms, as the authors' code computes them through its training "
                 "loader) or raw (the stored training images)",
    "train_transforms": "training augmentations, in batch on the device before normalization, per-image "
                        "parameters from the client's seeded generator: comma list of flip, rotate (+-30 deg, "
                        "nearest pixel, FedBN), rot90-flip (k x 90 deg, k in 0..4, then p 0.75 a "
                        "top-bottom, left-right or both flip: HarmoFL's and FedFA's prostate loaders; square "
                        "images), crop (pad size/8, reflect), jitter (brightness/contrast/saturation "
                        "0.4), jitter-hue (p 0.5, brightness/contrast/saturation/hue 0.2, gPerXAN), or none; on a "
                        "segmentation task flip, rotate, rot90-flip and crop move each mask with its image "
                        "(rotation fills it with background 0, crop reflects it), colour jitters leave masks alone",
    "seed": "seed of everything random; results do not depend on the number of ranks",
    "eval_every": "evaluate every N rounds (and after the last)",
    "select_by": "best round: val-mean (mean source-domain validation accuracy of the evaluated model), local-val "
                 "(clients' post-training local models' validation accuracy weighted by training samples, gPerXAN's "
                 "code; recorded as train.local_val_acc) or auto (the method's own: local-val for gperxan, else "
                 "val-mean); summary.csv's selection column names the rule",
    "eval_batch_size": "batch size for evaluation",
    "stream_above": "a client whose images exceed this many GiB streams them from its shard in blocks, read one "
                    "block ahead, instead of keeping them in (device) memory",
    "private_memory": "GiB of its clients' private state a client rank keeps in (device) memory; beyond it the "
                      "least recently used clients' state goes to files under $TMPDIR until they train again "
                      "(results are identical; 0 keeps only the client in use); that state (personal entries, control "
                      "variates, kept optimizer state) is created when a client first trains",
    "out": "run directory (default runs/<algo>-<data>-<model>-s<seed>-<time>); it belongs to one run: a "
           "directory holding a run's files or another run's directory, inside another run's, or in use by a live "
           "run is refused (symbolic links and .. count where they lead)",
    "device": "auto (GPU when visible), cpu, or cuda; client ranks bind node-local GPUs round-robin",
    "threads": "torch threads per client rank; 0 = cores on the node / client ranks sharing them",
    "fold_threads": "cores rank 0 adds the clients' uploads into its sums on: itself and N-1 helper processes, "
                    "each a range of the elements (the sums are the same bits for any count); 0 = the cores rank 0 "
                    "may run on less those its node's client ranks train on (their --threads), 1 to 8",
    "precision": "arithmetic of local training and evaluation: fp32, or bf16/fp16 autocast (weights, gradients "
                 "and aggregation stay fp32; fp16 scales the loss and unscales before the method's gradient "
                 "hooks); for GPUs: bf16 on a CPU is much slower than fp32",
    "channels_last": "store conv weights and images NHWC (faster with tensor cores)",
    "compile": "torch.compile each client rank's feature extractor (minutes of compiling once per rank; pays off "
               "on GPUs over long runs)",
    "deterministic": "deterministic CUDA kernels (torch.use_deterministic_algorithms, a fixed cuBLAS workspace, "
                     "cuDNN without benchmarking, global average pooling as a mean): a GPU run then repeats bit for "
                     "bit, over any number of ranks, as CPU runs always do; a model needing a kernel with no "
                     "deterministic GPU version is refused in one line (cost measured: none visible on an H200, "
                     "docs/benchmarks.md)",
    "gpu_buffers": "where a GPU rank's messages live: auto (on the GPU when the MPI library is CUDA-aware, else "
                   "pinned host memory; asked with MPIX_Query_cuda_support), pinned, or device (for a CUDA-aware MPI "
                   "that cannot say so: Cray MPICH, MVAPICH2-GDR; refused when the library says no)",
    "ckpt_every": "checkpoint every N rounds and after the last into <out>/checkpoint (0: only when SIGUSR1, "
                  "SIGTERM or a first Ctrl-C stops the run, which always checkpoints)",
    "round_timeout": "fail the job, with one line naming the rank, its pid and host, when a rank has not "
                     "answered for this many seconds (a hang); must exceed the longest round; 0 = wait forever",
    "peer_timeout": "end the job, with one line naming the rank and its host, when a rank hears nothing from a "
                    "peer for this many seconds: its node failed or is cut off the network (every rank sends its "
                    "peers a heartbeat each second, whatever it is doing, so a long round is not a silence; rank 0 "
                    "watches the client ranks, which give rank 0 a quarter more); exit 69; 0 = never",
    "track": "live trackers rank 0 sends the run to while it goes on, a comma list of tensorboard (event files "
             "in <out>/tracking/tensorboard), mlflow (a run in MLFLOW_TRACKING_URI's store, by default a SQLite "
             "store in <out>/tracking/mlflow) and wandb (a W&B run, offline in <out>/tracking unless WANDB_MODE "
             "and WANDB_DIR say otherwise): every record of metrics.jsonl as it is written, the options, and at the "
             "end the summaries and the report's tables and figures; each needs its extra (pip install "
             "'mpifl[mlflow]'); a resumed run continues the same tracker runs (the checkpoint names them); a "
             "tracker that fails while the run goes on is dropped with one warning line; the numbers never depend "
             "on it",
}

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
        options.append(_algo_option(opt, defaults))
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


def _algo_option(opt: Option, defaults: dict) -> click.Option:
    text = f"{opt.help} [{_defaults_text(defaults)}]"
    if opt.type is bool:
        return click.Option([opt.flag], is_flag=True, default=None, help=text)
    return click.Option([opt.flag], type=opt.type, default=None, help=text)


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


def command() -> click.Command:
    params = _core_options() + _algo_options() + [
        click.Option(["--config", "config_file"], type=str, default=None,
                     help="JSON or YAML file of options (keys as above, - or _); command-line flags override it"),
        click.Option(["--resume", "resume"], type=str, default=None,
                     help="continue RUN_DIR from its checkpoint, in that directory, up to --rounds, with its own "
                          "config.json: only " + ", ".join(map(_flag, RESUMABLE)) + " may change (options "
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
