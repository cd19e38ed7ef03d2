"""Run configuration: defaults < ``--config FILE`` < command line.

:data:`RUN_OPTIONS` declares every option a run has, once, as an :class:`Option`: type, default, check, help line,
group on the options page, whether a resume may change it, whether it names a result.  :data:`RunConfig`,
:func:`check`, :data:`RESUMABLE`, ``--help`` and docs/options.md (:mod:`mpifl.job`) and the report's grouping of
runs (:mod:`mpifl.report.runs`) derive from it.  A method's own options (``--mu``, ``--uniform-weights`` ...) are
:class:`Option` too, declared by its algorithm class, and live in ``RunConfig.algo_options``; one left unset takes
the default its algorithm declares.  The resolved configuration is written to the run directory as flat JSON,
which ``--config`` reads back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from ..errors import MpiflError
from ..models.norm import NORM_KINDS
from .normalize import AUGMENTATIONS, DRAWS, INPUT_NORMS, STATS_SOURCES

SEG_LOSSES = ("dice", "dice-ce", "sigmoid-dice")  # --seg-loss (mpifl.plan.task.SEGMENTATION_BY_LOSS)
#: --train-transforms, in the order they apply (mpifl.client.transforms; FedBN: flip, then rotate)
TRANSFORMS = ("flip", "rotate", "rot90-flip", "crop", "jitter", "jitter-hue")


def parse_names(text: str) -> tuple[str, ...]:
    """A comma list option of names (``--train-transforms``, ``--track``): ``"flip, crop"`` -> ("flip", "crop"),
    each once, in the given order; "" or "none" -> ()."""
    return tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"))


@dataclass(frozen=True)
class Option:
    """An option, turned into a CLI flag and a config key: one every run has (:data:`RUN_OPTIONS`) or one of a
    method's (its class's ``options``).  :meth:`problem` checks a value against its choices or its range."""

    name: str  # config key, e.g. "uniform_weights" -> --uniform-weights
    type: type
    default: Any
    help: str  # its line in --help (a run option's may name {methods}, {fresh_optimizer}, {datasets}, {models})
    choices: tuple[str, ...] = ()  # the values a rule option takes
    listed: bool = False  # it takes a comma list of its choices (parse_names)
    minimum: float | None = None  # least value; a count's (type int, required) is 0 or 1 as its meaning needs
    above: bool = False  # the value must exceed minimum (a rate: > 0)
    maximum: float | None = None  # greatest value
    below: bool = False  # the value must be under maximum (a decay rate: < 1)
    unit: str = ""  # of its range, for the check's message ("GiB", "seconds")
    zero: str = ""  # what 0 means, which is then taken whatever the minimum ("automatic", "never")
    # Every run's options only; a method's keep these defaults: fixed on resume, part of what names a result
    group: str = ""  # its group on the options page (mpifl.job.options_doc)
    resumable: bool = False  # a resumed run may change it: how and where it runs, not what it computes
    names_result: bool = True  # runs that differ in it are different configurations to the report (mpifl.report)

    def __post_init__(self):
        if self.type is int and self.minimum is None:
            raise TypeError(f"option {self.flag} counts something (type int): declare its least value, "
                            "minimum=0 or minimum=1, so that every count is checked alike")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not one this option takes (one line), or None."""
        if self.listed:
            if all(name in self.choices for name in parse_names(value)):
                return None
            return f"{self.flag} takes a comma list of {', '.join(self.choices)} (or none), got {value!r}"
        if self.choices and value not in self.choices:
            return f"{self.flag} must be one of {', '.join(self.choices)}, got {value!r}"
        if self.type is float and value is not None and not math.isfinite(value):
            return f"{self.flag} must be a finite number, got {value}"
        low, high = self.minimum, self.maximum
        if low is None or value is None or (value == 0 and self.zero):
            return None
        if (value > low if self.above else value >= low) and (high is None or (value < high if self.below
                                                                               else value <= high)):
            return None
        if high is None:
            bound = f"{'>' if self.above else '>='} {low}{' ' + self.unit if self.unit else ''}"
        else:
            bound = f"in {'(' if self.above else '['}{low}, {high}{')' if self.below else ']'}"
        return f"{self.flag} must be {bound}{f' (0 = {self.zero})' if self.zero else ''}, got {value}"


def _group(title: str, *options: Option) -> tuple[Option, ...]:
    """``options`` in the options page's group ``title``."""
    return tuple(replace(option, group=title) for option in options)


#: Every option a run has, by group, in the order of --help and of docs/options.md.  A new one is one entry here.
RUN_OPTIONS: tuple[Option, ...] = (
    *_group("Method, experiment and seed",
        Option("algo", str, "fedavg", "federated method: {methods}"),
        Option("preset", str, None, "one experiment of the papers (--list-presets): its dataset, model and "
               "hyperparameters, at the level of a config file (--config and flags override it); --algo picks the "
               "method"),
        Option("seed", int, 0, "seed of everything random; results do not depend on the number of ranks",
               minimum=0, names_result=False),
    ),
    *_group("Data and clients",
        Option("data", str, "styledigits", "dataset name (shards under --data-root); styledigits is generated on first "
               "use, others: {datasets}"),
        Option("data_root", str, "datasets", "directory holding <data>/<domain>.h5 shards (env MPIFL_DATA_ROOT)",
               resumable=True, names_result=False),
        Option("clients_per_domain", int, 1, "clients per domain (K): 1 = cross-silo; K > 1 splits each domain into K "
               "clients", minimum=1),
        Option("num_clients", int, 0, "total clients N dealt over the domains in turn (FedWon's sweep; label skew with "
               "--dirichlet); 0 = clients-per-domain x domains", minimum=0, zero="clients-per-domain x domains"),
        Option("fraction", float, 1.0, "fraction C of clients sampled per round (at least one), seeded",
               minimum=0, above=True, maximum=1),
        Option("dirichlet", float, 0.0, "split each domain among its clients by class proportions drawn from "
               "Dir(ALPHA) (label skew), the same proportions for train, val and test; 0 = even random split",
               minimum=0, zero="even splits"),
        Option("samples_per_client", int, 0, "keep a seeded subset of S training images per client (equal-size "
               "training sets); 0 = all", minimum=0, zero="all"),
        Option("percent", float, 1.0, "keep a seeded fraction P of each client's training images (FedBN's --percent; "
               "its 10 Digits-Five partitions of 743 images: --percent 0.1 is about one, --samples-per-client 743 "
               "exactly one)", minimum=0, above=True, maximum=1),
        Option("holdout", str, None, "leave-one-domain-out: DOMAIN never trains and is evaluated on all its images "
               "with the global model; 'all' runs every fold in turn into <out>/holdout-<domain> and writes a fold "
               "table to <out>/summary.md"),
    ),
    *_group("Model, normalization and augmentation",
        Option("model", str, "auto", "network (auto: the dataset's usual one, digitmodel for styledigits/digits, "
               "resnet18 for PACS/Office-Home/VLCS, alexnet for Office-Caltech/DomainNet): {models}; each is built "
               "with the normalization and conv kind its method asks for"),
        Option("norm", str, "auto", "normalization layers: auto (the method's own: bn for most, perxan gperxan, jsbn "
               "fedstein, agn fednn, none fedwon, gn/ln fedavg-gn/-ln), or one of bn, gn, ln, in, none, perxan, agn, "
               "jsbn, ibn (IBN-Net's IBN-a: IN on half the channels, BN on the rest; DenseNet: IN on the last 40 %), "
               "dson (DSON: learned mix of BN and IN statistics, every entry a BN side); a method whose rule needs its "
               "own kind refuses the others", choices=("auto",) + NORM_KINDS),
        Option("norm_blocks", str, "auto", "where perxan, ibn and dson layers go, plain shared BN elsewhere: auto (all "
               "for perxan and dson, every stage but the last for ibn, at IBN-Net's sites per architecture: ResNet "
               "block bn1, every third DenseNet norm1, MobileNetV2 each block's first norm, plain CNNs and U-Net every "
               "conv norm; the stem stays BN), all, N (the stem and the first N stages) or N-nostem (those stages "
               "without the stem); gperxan's --perxan-blocks is the same"),
        Option("pretrained", str, None, "local torchvision-format checkpoint to initialise the model from (no "
               "download); a classifier of another size is skipped; PerXAN models take BN weights on their BN side; "
               "inputs are then normalized with ImageNet's mean and std (--input-norm auto)"),
        Option("input_norm", str, "auto", "input normalization with --aug none: auto (the default: imagenet with "
               "--pretrained, else pooled; config.json stores the mode it resolves to), pooled (mean/std over the "
               "train images of every domain in the dataset build), domain (each domain's own train mean/std, a "
               "held-out domain's too), fixed (the dataset's reference-code constants: 0.5/0.5 Digits-Five, 0/1 "
               "Office-Caltech-10 and DomainNet-10, as FedBN's code; mean 0, std 1/255 on prostate, the unscaled "
               "0..255 of FedFA's and HarmoFL's loaders) or imagenet (ImageNet mean/std, for pre-trained backbones)",
               choices=INPUT_NORMS),
        Option("aug", str, "none", "input normalization plug-in for any algorithm: none (dataset normalization), norm "
               "(each client's own channel statistics), fedrdn (FedRDN: statistics drawn from all clients' in "
               "training, own at test), fedrdn-v (all clients' average)", choices=AUGMENTATIONS),
        Option("aug_draw", str, "batch", "FedRDN draws: batch (mean and std drawn independently per mini-batch, the "
               "authors' code) or sample (one client's pair per image, the paper's eq. 7)", choices=DRAWS),
        Option("aug_stats", str, "augmented", "images a client's own statistics (--aug norm/fedrdn/fedrdn-v) are "
               "computed on: augmented (one pass through --train-transforms, as the authors' code computes them "
               "through its training loader) or raw (the stored training images)", choices=STATS_SOURCES),
        Option("train_transforms", str, "none", "training augmentations, in batch on the device before normalization, "
               "per-image parameters from the client's seeded generator: comma list of flip, rotate (+-30 deg, nearest "
               "pixel, FedBN), rot90-flip (k x 90 deg, k in 0..4, then p 0.75 a top-bottom, left-right or both flip: "
               "HarmoFL's and FedFA's prostate loaders; square images), crop (pad size/8, reflect), jitter "
               "(brightness/contrast/saturation 0.4), jitter-hue (p 0.5, brightness/contrast/saturation/hue 0.2, "
               "gPerXAN), or none; on a segmentation task flip, rotate, rot90-flip and crop move each mask with its "
               "image (rotation fills it with background 0, crop reflects it), colour jitters leave masks alone",
               choices=TRANSFORMS, listed=True),
    ),
    *_group("Local training",
        Option("rounds", int, 10, "communication rounds", minimum=1, resumable=True),
        Option("local_epochs", int, 1, "local epochs per round (E)", minimum=1),
        Option("batch_size", int, 32, "local mini-batch size (B)", minimum=1),
        Option("lr", float, 0.01, "local learning rate (of round 1, before --lr-schedule)", minimum=0, above=True),
        Option("momentum", float, 0.0, "local SGD momentum (--optimizer sgd; the buffers are fresh each round unless "
               "--keep-optimizer)", minimum=0),
        Option("weight_decay", float, 0.0, "local weight decay (an L2 term in the gradient)", minimum=0),
        Option("optimizer", str, "sgd", "local optimizer: sgd, or adam (betas 0.9, 0.999; FedRDN's segmentation "
               "setting: --lr 1e-3 --weight-decay 1e-4; --momentum is refused with it)", choices=("sgd", "adam")),
        Option("keep_optimizer", bool, False, "keep each client's optimizer state (SGD momentum; Adam moments and "
               "steps) from one of its rounds to its next, as gPerXAN's code and FixBN's paper do: private state, "
               "checkpointed, never sent (default: a fresh optimizer each round; refused by the methods whose rule "
               "assumes one: {fresh_optimizer})"),
        Option("seg_loss", str, "dice", "training loss of a segmentation dataset, one for every method of a run: dice "
               "(softmax over all classes, background included; FedRDN's paper), dice-ce, (CE + Dice) / 2 (the HarmoFL "
               "and FedFA prostate code), or sigmoid-dice (ELCFS's code: a sigmoid head of the foreground classes "
               "only, Dice averaged over them, no CE; a pixel is foreground above 0.75); the Dice score counts every "
               "class whatever the loss; a classification dataset trains with cross-entropy", choices=SEG_LOSSES),
        Option("lr_schedule", str, "none", "learning rate of round r = 1..R (R: --schedule-rounds): none (--lr), exp "
               "(lr gamma^(r-1); FedNN: gamma 0.998), step (lr gamma^floor((r-1)/--lr-step)), or cosine (lr_min + (lr "
               "- lr_min)(1 + cos(pi r/R))/2, gPerXAN's code: round R trains at --lr-min, later rounds too)",
               choices=("none", "cosine", "step", "exp")),
        Option("lr_gamma", float, 0.1, "decay factor of --lr-schedule exp and step", minimum=0, above=True),
        Option("lr_step", int, 1, "rounds between two decays of --lr-schedule step", minimum=1),
        Option("lr_min", float, 0.0, "learning rate --lr-schedule cosine reaches in round R"),
        Option("schedule_rounds", int, 0, "R, the rounds that schedules over the run span (--lr-schedule cosine, "
               "FixBN's default switch, FedNN's temperature); 0 = --rounds. Stored in config.json: a run resumed with "
               "more --rounds keeps them (each schedule stays at its round-R value after R)",
               minimum=0, zero="--rounds"),
        Option("max_grad_norm", float, 0.0, "clip every local step's gradient to this L2 norm over all parameters, "
               "after the method's corrections (FedNN's code: 10, for every method); 0 = off",
               minimum=0, zero="no clipping"),
    ),
    *_group("Evaluation",
        Option("eval_every", int, 1, "evaluate every N rounds (and after the last)", minimum=1),
        Option("eval_batch_size", int, 512, "batch size for evaluation", minimum=1, resumable=True, names_result=False),
        Option("select_by", str, "auto", "best round: val-mean (mean source-domain validation accuracy of the "
               "evaluated model), local-val (clients' post-training local models' validation accuracy weighted by "
               "training samples, gPerXAN's code; recorded as train.local_val_acc) or auto (the method's own: "
               "local-val for gperxan, else val-mean); summary.csv's selection column names the rule",
               choices=("auto", "val-mean", "local-val")),
    ),
    *_group("Devices, speed and memory",
        Option("device", str, "auto", "auto (GPU when visible), cpu, or cuda; client ranks bind node-local GPUs "
               "round-robin", choices=("auto", "cpu", "cuda"), resumable=True, names_result=False),
        Option("threads", int, 0, "torch threads per client rank; 0 = cores on the node / client ranks sharing them",
               minimum=0, zero="automatic", resumable=True, names_result=False),
        Option("fold_threads", int, 0, "threads rank 0 adds the clients' uploads into its sums on, each a range of the "
               "elements (the same bits for any count; mpifl.server.folding); 0 = the cores rank 0 may run on less "
               "those its node's client ranks train on (their --threads), 1 to 8",
               minimum=0, zero="automatic", resumable=True, names_result=False),
        Option("precision", str, "fp32", "arithmetic of local training and evaluation: fp32, or bf16/fp16 autocast "
               "(weights, gradients and aggregation stay fp32; fp16 scales the loss and unscales before the method's "
               "gradient hooks); for GPUs: bf16 on a CPU is much slower than fp32", choices=("fp32", "bf16", "fp16")),
        Option("channels_last", bool, False, "store conv weights and images NHWC (faster with tensor cores)",
               names_result=False),
        Option("compile", bool, False, "torch.compile each client rank's feature extractor (minutes of compiling once "
               "per rank; pays off on GPUs over long runs)", names_result=False),
        Option("deterministic", bool, False, "deterministic CUDA kernels (torch.use_deterministic_algorithms, a fixed "
               "cuBLAS workspace, cuDNN without benchmarking, global average pooling as a mean): a GPU run then "
               "repeats bit for bit, over any number of ranks, as CPU runs always do; a model needing a kernel with no "
               "deterministic GPU version is refused in one line (cost measured: none visible on an H200, "
               "docs/benchmarks.md)", resumable=True),
        Option("gpu_buffers", str, "auto", "where a GPU rank's messages live: auto (on the GPU when the MPI library is "
               "CUDA-aware, else pinned host memory; asked with MPIX_Query_cuda_support), pinned, or device (for a "
               "CUDA-aware MPI that cannot say so: Cray MPICH, MVAPICH2-GDR; refused when the library says no)",
               choices=("auto", "pinned", "device"), resumable=True, names_result=False),
        Option("stream_above", float, 2.0, "a client whose images exceed this many GiB streams them from its shard in "
               "blocks, read one block ahead, instead of keeping them in (device) memory",
               minimum=0, unit="GiB", resumable=True, names_result=False),
        Option("private_memory", float, 8.0, "GiB of its clients' private state a client rank keeps in (device) "
               "memory; beyond it the least recently used clients' state goes to files under $TMPDIR until they train "
               "again (results are identical; 0 keeps only the client in use); that state (personal entries, control "
               "variates, kept optimizer state) is created when a client first trains",
               minimum=0, unit="GiB", resumable=True, names_result=False),
    ),
    *_group("Clients as they are: profiles, a simulated clock, round policies (docs/clients.md)",
        Option("client_speed", str, "", "each client's compute speed in images per second, drawn from (seed, client): "
               "a number, lognormal:MEDIAN,SIGMA, uniform:LOW,HIGH or DOMAIN=NUMBER,...; a local step takes "
               "--batch-size / speed simulated seconds; any option of this group turns the simulated clock on "
               "(metrics.jsonl's sim); default 100 when the clock runs"),
        Option("client_bandwidth", str, "", "each client's download bandwidth in MB/s, in the forms of --client-speed; "
               "default 10 when the clock runs"),
        Option("client_upload", str, "", "each client's upload bandwidth in MB/s, in the forms of --client-speed "
               "(default: the client's --client-bandwidth)"),
        Option("availability", str, "", "the probability a client is online when a round starts, drawn from (seed, "
               "round) for each client: a number in (0, 1], uniform:LOW,HIGH or DOMAIN=P,...; a round samples among "
               "the clients online (default: always)"),
        Option("client_trace", str, "", "trace file(s), comma-separated: mpifl's CSV (client,speed,down,up,active) or "
               "FedScale's device-capacity and availability pickles; a trace's values replace the options' for the "
               "clients it names (mpifl.plan.traces)"),
        Option("deadline", float, 0.0, "the round's deadline in simulated seconds: a client whose download, local "
               "steps and upload take longer is late (--late)", minimum=0, above=True, unit="seconds",
               zero="wait for all"),
        Option("late", str, "drop", "what a late client does: drop (left out, not trained) or partial (cut to the "
               "local steps that fit, FedProx's partial work)", choices=("drop", "partial")),
        Option("over_select", float, 1.0, "sample F x K clients and keep the first K uploads to arrive (the others "
               "are cancelled)", minimum=1),
        Option("drop_before", float, 0.0, "probability a sampled client drops out before training (no work, no "
               "upload), drawn from (seed, round)", minimum=0, maximum=1, below=True),
        Option("drop_after", float, 0.0, "probability a client that trained loses its upload (it keeps its own "
               "state; its upload never reaches the sums), drawn from (seed, round)", minimum=0, maximum=1,
               below=True),
    ),
    *_group("Client-level differential privacy (docs/privacy.md)",
        Option("dp_clip", float, 0.0, "DP-FedAvg: clip each sampled client's update (what it uploads less what it "
               "downloaded, every uploaded model entry) to this L2 norm C, then add Gaussian noise z C to the sum of "
               "the updates and divide by the expected number of clients (every client weighs 1); clients are then "
               "sampled independently with probability --fraction; needs the privacy extra (Opacus' accountant)",
               minimum=0, above=True, zero="no client-level DP"),
        Option("dp_noise", float, None, "the noise multiplier z (or give --dp-epsilon)", minimum=0, above=True),
        Option("dp_epsilon", float, None, "target epsilon after --rounds: z is the least noise that reaches it "
               "(Opacus' RDP accountant of the sampled Gaussian mechanism); config.json records both", minimum=0,
               above=True),
        Option("dp_delta", float, None, "delta of the guarantee (default 1/N, N the training clients)", minimum=0,
               above=True, maximum=1, below=True),
        Option("dp_mode", str, "central", "central: rank 0 (trusted) adds the noise to the sum; local: each client "
               "adds its own before upload", choices=("central", "local")),
        Option("dp_clipping", str, "fixed", "fixed: C throughout; adaptive: C tracks the --dp-quantile of the "
               "update norms (Andrew et al., NeurIPS 2021)", choices=("fixed", "adaptive")),
        Option("dp_quantile", float, 0.5, "adaptive clipping's target share gamma of updates left unclipped",
               minimum=0, above=True, maximum=1, below=True),
        Option("dp_clip_lr", float, 0.2, "adaptive clipping's step eta_C: C <- C exp(-eta_C (b - gamma))",
               minimum=0, above=True),
        Option("dp_count_noise", float, 0.0, "adaptive clipping's noise sigma_b on the count of unclipped updates",
               minimum=0, above=True, zero="m/20, m the expected clients per round"),
    ),
    *_group("Record-level privacy (DP-SGD)",
        Option("dpsgd_clip", float, 0.0, "DP-SGD inside every client (Abadi et al., CCS 2016; mpifl.privacy.dp_sgd): "
               "clip each record's gradient to this L2 norm C over the trainable parameters, add Gaussian noise of std "
               "--dpsgd-noise x C to the batch's sum, on Poisson-sampled batches (each record in with rate q = "
               "--batch-size / the client's training records); each client's epsilon over its own records (Opacus' "
               "RDP accountant) goes to metrics.jsonl and summary.md; a model with batch statistics (BatchNorm) or a "
               "method whose rule per-record clipping cannot follow is refused; 0 = off", minimum=0, above=True,
               zero="off"),
        Option("dpsgd_noise", float, 0.0, "DP-SGD noise multiplier sigma (noise std sigma x --dpsgd-clip on the "
               "summed clipped gradients); give it or --dpsgd-epsilon", minimum=0, above=True,
               zero="calibrated from --dpsgd-epsilon"),
        Option("dpsgd_epsilon", float, 0.0, "DP-SGD target epsilon: each client's sigma is calibrated (Opacus' "
               "get_noise_multiplier, RDP) so that its epsilon after the run's planned steps (the rounds it is sampled "
               "in up to --schedule-rounds, x local epochs x ceil(records / --batch-size)) is at most this; give it or "
               "--dpsgd-noise", minimum=0, above=True, zero="--dpsgd-noise gives sigma"),
        Option("dpsgd_delta", float, 0.0, "DP-SGD delta of each client's (epsilon, delta) guarantee over its records",
               minimum=0, above=True, maximum=1, below=True, zero="1 / the client's training records"),
    ),
    *_group("Secure aggregation (docs/privacy.md)",
        Option("secure_aggregation", bool, False, "secure aggregation (Bonawitz et al., CCS 2017): each client uploads "
               "its weighted terms in fixed point plus pairwise masks that cancel in the sum, so rank 0 only holds "
               "masked uploads and their sum (mpifl.privacy.secure); a method whose server rule reads single uploads "
               "(gathered entries, weights from training results) is refused"),
        Option("secagg_bits", int, 32, "bits B of secure aggregation's ring Z_2^B (words: int32 up to 32 bits, else "
               "int64); its fixed-point scale is 2^f, f = B - 1 - bit_length(K) - ceil(log2 --secagg-range) for K "
               "clients a round, so K terms never overflow, and each sum is within K / 2^(f+1) of the plain one",
               minimum=16, maximum=64),
        Option("secagg_range", float, 16.0, "the bound R on each client's weighted term |c_k x_k| under secure "
               "aggregation; a larger value is refused in one line naming the tensor", minimum=0, above=True),
    ),
    *_group("Run directory, checkpoints and failures",
        Option("out", str, None, "run directory (default runs/<algo>-<data>-<model>-s<seed>-<time>); it belongs to one "
               "run: a directory holding a run's files or another run's directory, inside another run's, or in use by "
               "a live run is refused (symbolic links and .. count where they lead)", names_result=False),
        Option("ckpt_every", int, 0, "checkpoint every N rounds and after the last into <out>/checkpoint (0: only when "
               "SIGUSR1, SIGTERM or a first Ctrl-C stops the run, which always checkpoints)",
               minimum=0, zero="only when stopped by a signal", resumable=True, names_result=False),
        Option("round_timeout", float, 0.0, "fail the job, with one line naming the rank, its pid and host, when a "
               "rank has not answered for this many seconds (a hang); must exceed the longest round; 0 = wait forever",
               minimum=0, unit="seconds", zero="wait forever", resumable=True, names_result=False),
        Option("peer_timeout", float, 60.0, "end the job, with one line naming the rank and its host, when a rank "
               "hears nothing from a peer for this many seconds: its node failed or is cut off the network (every rank "
               "sends its peers a heartbeat each second, whatever it is doing, so a long round is not a silence; rank "
               "0 watches the client ranks, which give rank 0 a quarter more); exit 69; 0 = never",
               minimum=1, unit="second", zero="never", resumable=True, names_result=False),
    ),
    *_group("Live tracking",
        Option("track", str, "none", "live trackers rank 0 sends the run to while it goes on, a comma list of "
               "tensorboard (event files in <out>/tracking/tensorboard), mlflow (a run in MLFLOW_TRACKING_URI's store, "
               "by default a SQLite store in <out>/tracking/mlflow) and wandb (a W&B run, offline in <out>/tracking "
               "unless WANDB_MODE and WANDB_DIR say otherwise): every record of metrics.jsonl as it is written, the "
               "options, and at the end the summaries and the report's tables and figures; each needs its extra (pip "
               "install 'mpifl[mlflow]'); a resumed run continues the same tracker runs (the checkpoint names them); a "
               "tracker that fails while the run goes on is dropped with one warning line; the numbers never depend on "
               "it", choices=("tensorboard", "mlflow", "wandb"), listed=True, resumable=True, names_result=False),
    ),
)


class _Configuration:
    """What a run's configuration does besides holding its options (:func:`run_config` adds them as fields)."""

    @property
    def horizon(self) -> int:
        """R, the rounds that schedules over the run span: ``--schedule-rounds``, or ``--rounds`` when 0.  The
        command line stores it in config.json, so a run resumed with more ``--rounds`` keeps its schedules."""
        return self.schedule_rounds or self.rounds

    @property
    def simulates_clients(self) -> bool:
        """Whether an option of the client conditions is given: the simulated clock runs (docs/clients.md)."""
        return bool(self.client_speed or self.client_bandwidth or self.client_upload or self.availability
                    or self.client_trace or self.deadline or self.over_select > 1 or self.drop_before
                    or self.drop_after)

    def opt(self, name: str) -> Any:
        """Value of a method-specific option (resolved by :func:`resolve`)."""
        return self.algo_options[name]

    def to_flat(self) -> dict:
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "algo_options"}
        flat.update(self.algo_options)
        return flat


def run_config(options: tuple[Option, ...]) -> type:
    """The dataclass of a run's configuration: a field per option (its name, type and default), in order, then
    ``algo_options``, the chosen method's own options by name."""
    fields = [(o.name, o.type, field(default=o.default)) for o in options]
    return dataclasses.make_dataclass("RunConfig", fields + [("algo_options", dict, field(default_factory=dict))],
                                      bases=(_Configuration,), namespace={"__module__": __name__})


RunConfig = run_config(RUN_OPTIONS)


def resumable(options: tuple[Option, ...]) -> tuple[str, ...]:
    """What a resumed run (``--resume RUN_DIR``) may change: how and where it runs, not what it computes.  Every
    other option, method options included, is the run's identity (:func:`mpifl.rundir.checkpoint.identity`): the
    command line refuses a change to it, the checkpoint records it, and ``--resume``'s help lists these."""
    return tuple(o.name for o in options if o.resumable)


RESUMABLE = resumable(RUN_OPTIONS)
#: The type of each option every run has (one that defaults to None takes a string)
CORE_TYPES = {o.name: o.type for o in RUN_OPTIONS}
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
    *((name, lambda cfg: cfg.dp_clip > 0, "with --dp-clip (client-level DP)")
      for name in ("dp_noise", "dp_epsilon", "dp_delta", "dp_mode", "dp_clipping")),
    *((name, lambda cfg: cfg.dp_clipping == "adaptive", "with --dp-clipping adaptive")
      for name in ("dp_quantile", "dp_clip_lr", "dp_count_noise")),
    *((name, lambda cfg: cfg.secure_aggregation, "with --secure-aggregation") for name in ("secagg_bits", "secagg_range")),
    ("late", lambda cfg: cfg.deadline > 0, "with --deadline"),
)


def check_acting(cfg: RunConfig, given: Mapping[str, Any]) -> None:
    """One line for an option the user ``given`` (command line, ``--config``: not a preset's base, not a resumed
    run's own file) that does nothing in this run (:data:`ACTS_ONLY`)."""
    defaults = RunConfig()
    for name, acts, where in ACTS_ONLY:
        if name in given and getattr(cfg, name) != getattr(defaults, name) and not acts(cfg):
            flag = "--" + name.replace("_", "-")
            raise MpiflError(f"{flag} {getattr(cfg, name)} acts only {where}, which this run is not; drop {flag}")


def check(cfg: RunConfig, options: tuple[Option, ...] = RUN_OPTIONS) -> None:
    """Values that every run must take (one-line errors): each option's own (:meth:`Option.problem`), then those
    that join several options."""
    for option in options:
        problem = option.problem(getattr(cfg, option.name))
        if problem:
            raise MpiflError(problem)
    rules = [
        (not (cfg.optimizer == "adam" and cfg.momentum), "--momentum applies to --optimizer sgd only; drop it "
                                                          "with --optimizer adam"),
        (not (cfg.keep_optimizer and cfg.optimizer == "sgd" and not cfg.momentum),
         "--keep-optimizer keeps SGD momentum buffers and --momentum is 0; give --momentum or drop --keep-optimizer"),
        (0 <= cfg.lr_min <= cfg.lr, "--lr-min must be in [0, --lr]"),
        (not (cfg.num_clients and cfg.clients_per_domain > 1),
         "give either --num-clients or --clients-per-domain, not both"),
        (not (cfg.samples_per_client and cfg.percent < 1), "give either --samples-per-client or --percent, not both"),
        (not cfg.dp_clip or cfg.dp_noise is not None or cfg.dp_epsilon is not None,
         "--dp-clip needs --dp-noise (the noise multiplier) or --dp-epsilon (a target the noise is chosen for)"),
        (cfg.dpsgd_clip or not (cfg.dpsgd_noise or cfg.dpsgd_epsilon or cfg.dpsgd_delta),
         "--dpsgd-noise, --dpsgd-epsilon and --dpsgd-delta act only with DP-SGD on: give --dpsgd-clip C or drop them"),
        (not cfg.dpsgd_clip or bool(cfg.dpsgd_noise) != bool(cfg.dpsgd_epsilon),
         "--dpsgd-clip: give the noise as either --dpsgd-noise SIGMA or --dpsgd-epsilon TARGET, not both or neither"),
    ]
    for ok, message in rules:
        if not ok:
            raise MpiflError(message)
