"""Every paper row of every preset and preset variant starts: the option and data checks of a real start pass,
nothing trains.

A row is started as a user types it: ``--preset NAME`` and the row's ``run`` values as flags, parsed by the
command line (:func:`mpifl.job.cli.configuration`), then checked as every rank checks it before round 1: the
dataset's manifest, the labels a Dirichlet split reads (:func:`mpifl.session.session.read_labels`),
:func:`mpifl.session.session.make_session` (the clients, the input normalization, the task, the model, the method)
and each one-time exchange's set-up: what ``--show-manifest`` runs (:func:`mpifl.job.show_manifest.manifest_text`), less
its table.  ``--holdout all`` is checked fold by fold, as :func:`mpifl.job.start._run_all_folds` starts them: a
fold that cannot start would otherwise be found only after the earlier folds trained.

The datasets are fakes with each converter's layout (domain ids, classes, channels, task, and the image size of
the preset's ``prepare`` line, else the converter's default): a manifest only, as nothing before training opens a
shard, except where a start reads labels (``--dirichlet``), which gets real shards of blank images.  Models are
built on PyTorch's meta device: the same code, without allocating or initialising weights.

Rows that need something from outside: CCST's ``--style-model DIR`` (the AdaIN weights, never downloaded) is
refused without it, in one line naming the option, and passes with the suite's fake folder (the ``style_model``
fixture); ``--pretrained PATH`` is optional in every preset (the gPerXAN notes), so no row gets it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import numpy as np
import pytest
import torch

from mpifl.data import camelyon, cifar, digits, ensure_dataset, fairface, isic, prostate
from mpifl.data.benchmarks import BENCHMARKS
from mpifl.data.manifest import DatasetManifest, build_manifest
from mpifl.data.shard import ShardWriter
from mpifl.errors import MpiflError
from mpifl.job.cli import configuration
from mpifl.plan.config import Option
from mpifl.presets import all_presets, load_preset, variant_names
from mpifl.session import session

#: each converter's layout: domain ids, classes, default image size, channels, task
LAYOUTS = {
    "digits": (list(digits.DOMAINS), digits.CLASSES, digits.DEFAULT_SIZE, 3, "classification"),
    **{name: ([d.id for d in spec.domains], list(spec.classes or [f"class{i}" for i in range(spec.num_classes)]),
              spec.default_size, 3, "classification") for name, spec in BENCHMARKS.items()},
    "cifar10": (["cifar10"], cifar.CIFAR10_CLASSES, cifar.DEFAULT_SIZE, 3, "classification"),
    "cifar10c": (list(cifar.CORRUPTIONS), cifar.CIFAR10_CLASSES, cifar.DEFAULT_SIZE, 3, "classification"),
    "camelyon17": ([camelyon.domain_id(i) for i in range(camelyon.HOSPITALS)], camelyon.CLASSES,
                   camelyon.DEFAULT_SIZE, 3, "classification"),
    "isic2019": ([isic.domain_id(i) for i in range(len(isic.CENTERS))], isic.CLASSES, isic.DEFAULT_SIZE, 3,
                 "classification"),
    "fairface": (sorted(fairface.RACES.values()), fairface.CLASSES, fairface.DEFAULT_SIZE, 3, "classification"),
    "prostate": (list(prostate.SITES), prostate.CLASSES, prostate.DEFAULT_SIZE,
                 3 if prostate.STACK_NEIGHBOURS else 1, "segmentation"),
}
#: split sizes of a manifest-only fake: at least every preset's sampling asks for (FedWon's 6600 per client)
SIZES = {"train": 8000, "val": 1000, "test": 2000}
#: split sizes of a fake with shards (a start reads its labels)
SHARD_SIZES = {"train": 5000, "val": 500, "test": 1000}

PRESETS = all_presets() + [load_preset(name) for name in variant_names()]


def _normalize(channels: int) -> dict:
    """The fakes' manifest normalization (their images are blank)."""
    return {"mean": [0.5] * channels, "std": [0.25] * channels}


def _size(preset) -> int:
    """The image size the preset's ``prepare`` line asks for, else the converter's default."""
    found = re.search(r"--size (\d+)", preset.prepare)
    return int(found.group(1)) if found else LAYOUTS[preset.data][2]


def _fake(root, name: str, size: int, shards: bool) -> None:
    domains, classes, _, channels, task = LAYOUTS[name]
    if shards:
        rng = np.random.default_rng(0)
        for domain in domains:
            with ShardWriter(root / name / f"{domain}.h5", dataset=name, domain=domain, classes=classes,
                             image_size=(size, size), channels=channels, source="fake", task=task) as writer:
                for split, n in SHARD_SIZES.items():
                    writer.add(split, np.zeros((n, size, size, channels), np.uint8),
                               rng.integers(len(classes), size=n))
        build_manifest(root, name, source="fake", protocol={}, normalize=_normalize(channels))
        return
    (root / name).mkdir(parents=True)
    DatasetManifest(name=name, domains=domains, classes=list(classes), image_size=(size, size), channels=channels,
                    splits={d: dict(SIZES) for d in domains}, normalize=_normalize(channels),
                    shards={d: {"file": f"{d}.h5", "sha256": "0" * 64, "bytes": 1} for d in domains},
                    source="fake", protocol={}, task=task).write(root)


@pytest.fixture(scope="module")
def data_roots(tmp_path_factory) -> dict:
    """One data root per image size, holding a fake of each dataset the presets use at that size."""
    roots, done = {}, set()
    for preset in PRESETS:
        size = _size(preset)
        root = roots.setdefault(size, tmp_path_factory.mktemp(f"presets-{size}px"))
        if (preset.data, size) not in done:
            shards = any(p.data == preset.data and _size(p) == size and p.options.get("dirichlet") for p in PRESETS)
            _fake(root, preset.data, size, shards)
            done.add((preset.data, size))
    return roots


def _flags(values: dict) -> list[str]:
    """Config values as the command-line flags that set them."""
    args = []
    for key, value in values.items():
        flag = Option(key, object, None, "").flag
        if value is True:
            args.append(flag)
        else:
            assert not isinstance(value, bool), f"{key}: false is the default, not a flag"
            args += [flag, str(value)]
    return args


def _start_checks(argv: list[str], monkeypatch) -> None:
    """What a start checks before round 1 (module docstring); a refusal raises its one-line MpiflError.

    The folds of ``--holdout all`` share the network of the first (every fold builds it from the same options;
    the folds differ in their clients): built once per fold, ResNet-50 and DenseNet-121 would take most of this
    test's time."""
    cfg, _ = configuration(argv)
    built, build = {}, session._model

    def network(fold_cfg, manifest, algo_cls):
        key = (algo_cls, repr(dataclasses.replace(fold_cfg, holdout=cfg.holdout)))
        if key not in built:
            built[key] = build(fold_cfg, manifest, algo_cls)
        return built[key]

    monkeypatch.setattr(session, "_model", network)
    manifest = ensure_dataset(cfg.data_root, cfg.data)
    folds = [dataclasses.replace(cfg, holdout=d) for d in manifest.domains] if cfg.holdout == "all" else [cfg]
    # the networks on the meta device (no memory, no arithmetic), but for CCST with its AdaIN weights, which are
    # read into the style network and must stay real
    with contextlib.nullcontext() if "--style-model" in argv else torch.device("meta"):
        for fold in folds:
            started = session.make_session(fold, manifest, num_hosts=1, labels=session.read_labels(fold, manifest))
            for exchange in started.exchanges:
                exchange.setup_exchange()


def _argv(preset, row, root) -> list[str]:
    return ["--preset", preset.name, *_flags(row.run), "--data-root", str(root)]


ROWS = [pytest.param(preset, row, id=f"{preset.name}/{row.method}") for preset in PRESETS for row in preset.results]


@pytest.mark.parametrize("preset, row", ROWS)
def test_every_paper_row_passes_the_checks_of_a_real_start(preset, row, data_roots, monkeypatch, request):
    argv = _argv(preset, row, data_roots[_size(preset)])
    if row.algo == "ccst":
        with pytest.raises(MpiflError, match=r"^ccst stylizes with the AdaIN network, whose weights cannot be "
                                             r"downloaded here: give --style-model DIR, a folder holding ") as refused:
            _start_checks(argv, monkeypatch)
        assert "\n" not in str(refused.value)
        argv += ["--style-model", str(request.getfixturevalue("style_model"))]
    _start_checks(argv, monkeypatch)
