"""Run configuration: defaults < ``--config FILE`` < command line.

:class:`RunConfig` holds the options every run has.  Options that belong to
one method (``--mu``, ``--uniform-weights`` ...) are declared by the
algorithm classes themselves as :class:`Option` and live in
``RunConfig.algo_options``; an option left unset takes the default its
algorithm declares.  The resolved configuration is written to the run
directory as flat JSON, which ``--config`` reads back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import MpiflError
from ..models.norm import NORM_KINDS
from .normalize import AUGMENTATIONS, DRAWS, INPUT_NORMS, STATS_SOURCES

OPTIMIZERS = ("sgd", "adam")  # --optimizer (mpifl.plan.optim)
SEG_LOSSES = ("dice", "dice-ce", "sigmoid-dice")  # --seg-loss (mpifl.plan.task.SEGMENTATION_BY_LOSS)
LR_SCHEDULES = ("none", "cosine", "step", "exp")  # --lr-schedule (mpifl.plan.optim.round_lr)
#: --train-transforms, in the order they apply (mpifl.client.transforms; FedBN: flip, then rotate)
TRANSFORMS = ("flip", "rotate", "rot90-flip", "crop", "jitter", "jitter-hue")


#: ``--track``: where rank 0 sends the run's records while it goes on (mpifl.server.tracking)
TRACKERS = ("tensorboard", "mlflow", "wandb")


def parse_names(text: str) -> tuple[str, ...]:
    """A comma list option of names (``--train-transforms``, ``--track``): ``"flip, crop"`` -> ("flip", "crop"),
    each once, in the given order; "" or "none" -> ()."""
    return tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"))


#: ``--select-by``: the rule choosing a run's best round (mpifl.server.run_log.summary_rows); auto = the method's
SELECT_BY = ("auto", "val-mean", "local-val")


@dataclass(frozen=True)
class Option:
    """A method-specific option, turned into a CLI flag and a config key."""

    name: str  # config key, e.g. "uniform_weights" -> --uniform-weights
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()  # the values a rule option takes (checked by Algorithm.check_options)
    minimum: int | None = None  # a count's least value, 0 or 1 as its meaning needs (checked likewise)

    def __post_init__(self):
        if self.type is int and self.minimum is None:
            raise TypeError(f"option {self.flag} counts something (type int): declare its least value, "
                            "minimum=0 or minimum=1, so that every count is checked alike")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not one this option takes (one line), or None."""
        if self.choices and value not in self.choices:
            return f"{self.flag} must be one of {', '.join(self.choices)}, got {value!r}"
        if self.minimum is not None and value is not None and value < self.minimum:
            return f"{self.flag} must be >= {self.minimum}, got {value}"
        return None


@dataclass
class RunConfig:
    algo: str = "fedavg"
    data: str = "styledigits"
    data_root: str = "datasets"
    model: str = "auto"
    norm: str = "auto"  # auto: the method's own kind (Algorithm.norm)
    norm_blocks: str = "auto"  # placement of composite norms (mpifl.models.surgery.place_composite_norms)
    pretrained: str | None = None
    rounds: int = 10
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    optimizer: str = "sgd"
    seg_loss: str = "dice"
    lr_schedule: str = "none"
    lr_gamma: float = 0.1
    lr_step: int = 1
    lr_min: float = 0.0
    schedule_rounds: int = 0  # 0: --rounds; build_config stores the value (see horizon)
    max_grad_norm: float = 0.0
    keep_optimizer: bool = False
    clients_per_domain: int = 1
    num_clients: int = 0
    dirichlet: float = 0.0
    samples_per_client: int = 0
    percent: float = 1.0
    fraction: float = 1.0
    holdout: str | None = None
    input_norm: str = "auto"  # build_config stores the mode it resolves to
    aug: str = "none"
    aug_draw: str = "batch"
    aug_stats: str = "augmented"
    train_transforms: str = "none"
    seed: int = 0
    eval_every: int = 1
    select_by: str = "auto"  # best-round rule (SELECT_BY)
    eval_batch_size: int = 512
    stream_above: float = 2.0
    private_memory: float = 8.0  # GiB of hosted clients' private state a client rank keeps in memory
    out: str | None = None
    device: str = "auto"
    threads: int = 0
    fold_threads: int = 0  # rank 0's threads for folding the uploads (mpifl.transport.topology.fold_threads)
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    deterministic: bool = False  # deterministic CUDA kernels (mpifl.client.devices.deterministic_kernels)
    gpu_buffers: str = "auto"
    ckpt_every: int = 0
    round_timeout: float = 0.0
    peer_timeout: float = 60.0  # seconds of silence after which a peer is lost (mpifl.transport.liveness)
    track: str = "none"  # live trackers, a comma list of TRACKERS (parse_names)
    preset: str | None = None  # --preset NAME (mpifl.presets); kept in config.json for mpifl.report
    algo_options: dict = field(default_factory=dict)

    @property
    def horizon(self) -> int:
        """R, the rounds that schedules over the run span: ``--schedule-rounds``, or ``--rounds`` when 0.  The
        command line stores it in config.json, so a run resumed with more ``--rounds`` keeps its schedules."""
        return self.schedule_rounds or self.rounds

    def opt(self, name: str) -> Any:
        """Value of a method-specific option (resolved by :func:`resolve`)."""
        return self.algo_options[name]

    def to_flat(self) -> dict:
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "algo_options"}
        flat.update(self.algo_options)
        return flat


#: What a resumed run (``--resume RUN_DIR``) may change: how and where it runs, not what it computes.  Every other
#: option, method options included, is the run's identity (:func:`mpifl.rundir.checkpoint.identity`): the command
#: line refuses a change to it, the checkpoint records it, and ``--resume``'s help lists these.
RESUMABLE = ("rounds", "data_root", "device", "threads", "fold_threads", "eval_batch_size", "stream_above",
             "private_memory", "ckpt_every", "round_timeout", "peer_timeout", "gpu_buffers", "deterministic", "track")


#: The type of each option every run has (one that defaults to None takes a string)
CORE_TYPES = {f.name: (str if f.default is None else type(f.default))
              for f in dataclasses.fields(RunConfig) if f.name != "algo_options"}
CORE_KEYS = tuple(CORE_TYPES)


def read_config_file(path: str | Path) -> dict:
    """Flat mapping from a JSON or YAML file; dashes in keys become underscores.  A key given twice (also as
    ``a-b`` and ``a_b``) is refused: which of its values a run took would be the parser's choice."""
    path = Path(path)
    if not path.is_file():
        raise MpiflError(f"config file not found: {path}; pass an existing JSON or YAML file to --config")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            pairs = json.loads(text, object_pairs_hook=_Pairs)
        else:
            pairs = _yaml_pairs(text)
    except MpiflError:
        raise
    except Exception as exc:  # parse errors of either format
        raise MpiflError(f"cannot parse config file {path}: {str(exc).splitlines()[0]}; fix its syntax")
    if not isinstance(pairs, _Pairs):
        raise MpiflError(f"config file {path} must hold a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in _mapping(pairs, path).items()}


class _Pairs(list):
    """A mapping as the file spells it: its (key, value) pairs in order, duplicates kept for the check."""


def _mapping(pairs: _Pairs, path: Path, where: str = "") -> dict:
    """``pairs`` as a dict (mappings inside it too); a key given twice is refused in one line."""
    data: dict = {}
    for key, value in pairs:
        name = str(key).replace("-", "_") if not where else key
        if name in data:
            raise MpiflError(f"config file {path} gives {where or 'option '}{name} twice; keep one")
        data[name] = _mapping(value, path, f"{where}{name}.") if isinstance(value, _Pairs) else value
    return data


def _yaml_pairs(text: str):
    """The YAML document with every mapping as its pairs (:class:`_Pairs`); plain values as ``safe_load``'s."""
    import yaml

    class PairLoader(yaml.SafeLoader):
        pass

    def pairs(loader, node):
        return _Pairs(loader.construct_pairs(node, deep=True))

    PairLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, pairs)
    return yaml.load(text, Loader=PairLoader)  # noqa: S506 (a SafeLoader: no object is constructed from tags)


def resolve(file_values: Mapping[str, Any], cli_values: Mapping[str, Any],
            algo_options: Mapping[str, Option]) -> RunConfig:
    """Merge file then command-line values over defaults and check types.

    ``algo_options`` are all options declared by the chosen algorithm; a key
    that no algorithm and no core field knows is an error, a key declared by
    another algorithm only is kept in the file but reported by the caller.
    """
    merged = {**file_values, **cli_values}
    unknown = sorted(k for k in merged if k not in CORE_KEYS and k not in algo_options)
    if unknown:
        raise MpiflError(f"unknown option(s) {', '.join(unknown)}; see `python -m mpifl.run --help` for valid names")
    core = {k: coerce(k, v, CORE_TYPES[k]) for k, v in merged.items() if k in CORE_KEYS and v is not None}
    algo = {name: coerce(name, merged.get(name), opt.type) if merged.get(name) is not None else opt.default
            for name, opt in algo_options.items()}
    return RunConfig(**core, algo_options=algo)


def coerce(name: str, value: Any, kind: type) -> Any:
    """``value`` of option ``name`` as ``kind`` (from a file, strings such as 'true' or '3'); one line if it is not."""
    if kind is str:
        return str(value)
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        number = kind(value)
    except (TypeError, ValueError):
        raise MpiflError(f"option {name} must be {kind.__name__}, got {value!r}")
    if kind is float and not math.isfinite(number):  # nan, inf, 1e400: no option means them
        raise MpiflError(f"--{name.replace('_', '-')} must be a finite number, got {value!r}")
    return number


#: Options that act only under another's value: (name, whether it acts in a run, where it acts).  Given a value of
#: its own where it does not act, it would be recorded in config.json as if it had: :func:`check_acting` refuses it.
ACTS_ONLY = (
    ("input_norm", lambda cfg: cfg.aug == "none", "with --aug none (another --aug normalizes with client statistics)"),
    ("aug_stats", lambda cfg: cfg.aug != "none", "with --aug norm, fedrdn or fedrdn-v (client statistics)"),
    ("aug_draw", lambda cfg: cfg.aug == "fedrdn", "with --aug fedrdn (its draws)"),
)


def check_acting(cfg: RunConfig, given: Mapping[str, Any]) -> None:
    """One line for an option the user ``given`` (command line, ``--config``: not a preset's base, not a resumed
    run's own file) that does nothing in this run (:data:`ACTS_ONLY`)."""
    defaults = RunConfig()
    for name, acts, where in ACTS_ONLY:
        if name in given and getattr(cfg, name) != getattr(defaults, name) and not acts(cfg):
            flag = "--" + name.replace("_", "-")
            raise MpiflError(f"{flag} {getattr(cfg, name)} acts only {where}, and this run has --aug {cfg.aug}; "
                             f"drop {flag}")


def check(cfg: RunConfig) -> None:
    """Value ranges that every run must satisfy (one-line errors)."""
    rules = [
        (cfg.norm in ("auto",) + NORM_KINDS, f"--norm must be auto or one of {', '.join(NORM_KINDS)}"),
        (cfg.rounds >= 1, "--rounds must be >= 1"),
        (cfg.local_epochs >= 1, "--local-epochs must be >= 1"),
        (cfg.batch_size >= 1, "--batch-size must be >= 1"),
        (cfg.eval_batch_size >= 1, "--eval-batch-size must be >= 1"),
        (cfg.stream_above >= 0, "--stream-above must be >= 0 GiB"),
        (cfg.private_memory >= 0, "--private-memory must be >= 0 GiB"),
        (cfg.lr > 0, "--lr must be > 0"),
        (cfg.momentum >= 0, "--momentum must be >= 0"),
        (cfg.weight_decay >= 0, "--weight-decay must be >= 0"),
        (cfg.optimizer in OPTIMIZERS, f"--optimizer must be one of {', '.join(OPTIMIZERS)}"),
        (cfg.seg_loss in SEG_LOSSES, f"--seg-loss must be one of {', '.join(SEG_LOSSES)}"),
        (not (cfg.optimizer == "adam" and cfg.momentum), "--momentum applies to --optimizer sgd only; drop it "
                                                          "with --optimizer adam"),
        (not (cfg.keep_optimizer and cfg.optimizer == "sgd" and not cfg.momentum),
         "--keep-optimizer keeps SGD momentum buffers and --momentum is 0; give --momentum or drop --keep-optimizer"),
        (cfg.lr_schedule in LR_SCHEDULES, f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}"),
        (cfg.lr_gamma > 0, "--lr-gamma must be > 0"),
        (cfg.lr_step >= 1, "--lr-step must be >= 1"),
        (0 <= cfg.lr_min <= cfg.lr, "--lr-min must be in [0, --lr]"),
        (cfg.schedule_rounds >= 0, "--schedule-rounds must be >= 0 (0 = --rounds)"),
        (cfg.max_grad_norm >= 0, "--max-grad-norm must be >= 0 (0 = no clipping)"),
        (cfg.clients_per_domain >= 1, "--clients-per-domain must be >= 1"),
        (cfg.num_clients >= 0, "--num-clients must be >= 0 (0 = clients-per-domain x domains)"),
        (not (cfg.num_clients and cfg.clients_per_domain > 1),
         "give either --num-clients or --clients-per-domain, not both"),
        (cfg.dirichlet >= 0, "--dirichlet must be > 0 (or 0 for even splits)"),
        (cfg.samples_per_client >= 0, "--samples-per-client must be >= 0 (0 = all)"),
        (0 < cfg.percent <= 1, "--percent must be in (0, 1]"),
        (not (cfg.samples_per_client and cfg.percent < 1), "give either --samples-per-client or --percent, not both"),
        (0 < cfg.fraction <= 1, "--fraction must be in (0, 1]"),
        (cfg.eval_every >= 1, "--eval-every must be >= 1"),
        (cfg.seed >= 0, "--seed must be >= 0"),
        (cfg.select_by in SELECT_BY, f"--select-by must be one of {', '.join(SELECT_BY)}"),
        (cfg.threads >= 0, "--threads must be >= 0 (0 = automatic)"),
        (cfg.fold_threads >= 0, "--fold-threads must be >= 0 (0 = automatic)"),
        (cfg.ckpt_every >= 0, "--ckpt-every must be >= 0 (0 = only when stopped by a signal)"),
        (cfg.round_timeout >= 0, "--round-timeout must be >= 0 seconds (0 = wait forever)"),
        (cfg.peer_timeout == 0 or cfg.peer_timeout >= 1, "--peer-timeout must be at least 1 second (0 = never)"),
        (cfg.device in ("auto", "cpu", "cuda"), "--device must be auto, cpu or cuda"),
        (cfg.precision in ("fp32", "bf16", "fp16"), "--precision must be fp32, bf16 or fp16"),
        (cfg.gpu_buffers in ("auto", "pinned", "device"), "--gpu-buffers must be auto, pinned or device"),
        (cfg.input_norm in INPUT_NORMS, f"--input-norm must be one of {', '.join(INPUT_NORMS)}"),
        (cfg.aug in AUGMENTATIONS, f"--aug must be one of {', '.join(AUGMENTATIONS)}"),
        (all(t in TRANSFORMS for t in parse_names(cfg.train_transforms)),
         f"--train-transforms takes a comma list of {', '.join(TRANSFORMS)} (or none)"),
        (cfg.aug_draw in DRAWS, f"--aug-draw must be one of {', '.join(DRAWS)}"),
        (cfg.aug_stats in STATS_SOURCES, f"--aug-stats must be one of {', '.join(STATS_SOURCES)}"),
        (all(t in TRACKERS for t in parse_names(cfg.track)),
         f"--track takes a comma list of {', '.join(TRACKERS)} (or none)"),
    ]
    for ok, message in rules:
        if not ok:
            raise MpiflError(message)
