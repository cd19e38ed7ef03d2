"""Which datasets mpifl knows, where they live, and getting one ready to use.

A dataset is a directory ``<root>/<name>/`` with shards and a manifest (see
:mod:`mpifl.data.manifest`).  The generated ``styledigits`` and ``styleshapes`` are
built on first use; every other dataset is converted once with ``python -m mpifl.data
prepare`` or copied in as a prepared shard directory, which then loads
whatever its name.
"""

from __future__ import annotations

import os
from pathlib import Path

from mpifl.errors import MpiflError
from mpifl.data.generated import NAME as GENERATED_NAME
from mpifl.data.generated import generate_styledigits
from mpifl.data.shapes import NAME as SHAPES_NAME
from mpifl.data.shapes import generate_styleshapes
from mpifl.data.manifest import MANIFEST, DatasetManifest, check_name

KNOWN_DATASETS = {
    GENERATED_NAME: "generated digits in 5 styles (mono, paper, street, texture, outline), 28 px",
    SHAPES_NAME: "generated shapes to segment (background/shape masks) in 5 styles (flat, texture, mri, outline, "
                 "blurred), 32 px",
    "pacs": "PACS: 7 classes in 4 domains (art_painting, cartoon, photo, sketch)",
    "office_caltech": "Office-Caltech-10: 10 classes in 4 domains (amazon, caltech, dslr, webcam)",
    "officehome": "Office-Home: 65 classes in 4 domains (art, clipart, product, real_world)",
    "domainnet": "DomainNet: 345 classes in 6 domains (clipart, infograph, painting, quickdraw, real,"
                 " sketch)",
    "domainnet10": "DomainNet, the 10-class subset used by FedBN, in its 6 domains",
    "vlcs": "VLCS: 5 classes in 4 domains (caltech, labelme, pascal, sun)",
    "digits": "Digits-Five: 10 classes in 5 domains (mnist, svhn, usps, synth, mnistm), 28 px, FedBN's"
              " 80/20 split",
    "cifar10": "CIFAR-10: 10 classes, one domain (label-skew experiments), 32 px",
    "cifar10c": "CIFAR-10-C: CIFAR-10 test images under corruptions, one domain per corruption, one"
                " severity (--severity, default 5), 32 px",
    "camelyon17": "Camelyon17-WILDS: tumour patches, 2 classes, 5 hospitals (hospital0..hospital4), 96 px",
    "isic2019": "Fed-ISIC2019 (FLamby): skin lesions, 8 classes, 6 centres (center0..center5), 224 px",
    "fairface": "FairFace: faces, gender (2 classes) in 7 race domains, 224 px",
    "prostate": "multi-site prostate MRI (SAML release): binary segmentation, 6 sites (BIDMC, HK, I2CVB, BMC, "
                "RUNMC, UCL), 384 px",
}


# The network a run uses when --model is not given: the papers' choice for the
# dataset, scaled to what runs on one GPU (gPerXAN uses ResNet-50 at 224 px on
# PACS/Office-Home, FedDG work commonly ResNet-18; FedBN/FedRDN use their
# AlexNet on Office-Caltech-10 and DomainNet; FedNN ResNet-20 on CIFAR-10; WILDS
# DenseNet-121 on Camelyon17).
DEFAULT_MODELS = {
    GENERATED_NAME: "digitmodel", "digits": "digitmodel", SHAPES_NAME: "unet",
    "pacs": "resnet18", "officehome": "resnet18", "vlcs": "resnet18",
    "office_caltech": "alexnet", "domainnet": "alexnet", "domainnet10": "alexnet",
    "cifar10": "resnet20", "cifar10c": "resnet20",
    "camelyon17": "densenet121", "isic2019": "resnet18", "fairface": "resnet18", "prostate": "unet",
}


#: ``--input-norm fixed``: the constant (mean, std) per channel a dataset's reference code normalizes with.
FIXED_NORMALIZATION = {
    # FedBN's Digits-Five code: Normalize(0.5, 0.5) on [0, 1] pixels (styledigits stands in for Digits-Five)
    GENERATED_NAME: ([0.5] * 3, [0.5] * 3), "digits": ([0.5] * 3, [0.5] * 3),
    # FedBN's Office-Caltech-10 and DomainNet code: ToTensor() only, so [0, 1] pixels
    "office_caltech": ([0.0] * 3, [1.0] * 3), "domainnet10": ([0.0] * 3, [1.0] * 3),
    # FedFA's and HarmoFL's prostate loaders: torch.Tensor(uint8 slices), so unscaled 0..255 intensities
    "prostate": ([0.0] * 3, [1 / 255] * 3),
}


#: the datasets built on first use, and their builders
GENERATORS = {GENERATED_NAME: generate_styledigits, SHAPES_NAME: generate_styleshapes}


def default_model(dataset: str) -> str:
    """``--model auto``: the dataset's usual network (smallcnn for a dataset mpifl does not know)."""
    return DEFAULT_MODELS.get(dataset, "smallcnn")


def default_data_root() -> Path:
    """``$MPIFL_DATA_ROOT``, or ``datasets`` relative to the working directory."""
    return Path(os.environ.get("MPIFL_DATA_ROOT", "datasets"))


def ensure_dataset(root, name: str) -> DatasetManifest:
    """The manifest of dataset ``name`` under ``root``, generating ``styledigits`` or ``styleshapes`` if needed."""
    check_name(name)
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise MpiflError(f"data root {root} is a file, not a directory; pass --data-root (or MPIFL_DATA_ROOT) the "
                         "directory that holds the datasets, <root>/<name>/manifest.json")
    try:
        if name in GENERATORS:
            if not (root / name / MANIFEST).is_file():
                return GENERATORS[name](root)
            return DatasetManifest.load(root, name)
        if (root / name).is_dir() or name in KNOWN_DATASETS:
            return DatasetManifest.load(root, name)
    except OSError as exc:  # permissions, a read-only or full file system, a path through a file
        raise MpiflError(f"cannot use the data root {root}: {exc.strerror or exc} ({exc.filename or root}); pass a "
                         "--data-root this user can read (and, for generated data, write)") from None
    raise MpiflError(f"unknown dataset '{name}' (no directory {root / name}); known: "
                     f"{', '.join(KNOWN_DATASETS)}; or put a prepared shard directory at {root / name}")

