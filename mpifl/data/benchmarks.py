"""The image-folder benchmarks: one :class:`~mpifl.data.folders.FolderSpec` each.

``python -m mpifl.data prepare NAME --src DIR [--size S] [--data-root ROOT]``
converts them with :func:`mpifl.data.folders.convert_folders`.  Splits, per
dataset, and where they come from:

==================  =======  =====================================================================
name                size     split
==================  =======  =====================================================================
``pacs``            224      with ``<domain>_{train,crossval,test}_kfold.txt`` in ``--src``: the
                             official lists of Li et al. (ICCV 2017), labels 1-based.  Their train
                             and crossval lists partition each domain about 90/10; ``test_kfold``
                             is the *whole* domain (the domain-generalization protocol tests a
                             held-out domain), so test then overlaps train/val: the manifest says
                             so (``test_overlaps_train``).  Without the lists: a seeded stratified
                             70/10/20 train/val/test split per domain (an mpifl choice for
                             multi-domain FL, where every client is tested on its own domain).
                             224 px as in gPerXAN's public code; the images are 227 px.
``office_caltech``  256      no official split.  Seeded stratified 72/8/20: test 20 % as in
                             FedBN's 80/20 stratified Digits preprocessing (its Office-Caltech
                             split ships only as pickles), then 10 % of the train part as val
                             (FedBN too validates on part of its train split).  256 px as in FedBN.
``officehome``      224      no official split: seeded stratified 70/10/20 (mpifl choice).
``vlcs``            224      with ``<DOMAIN>/{train,crossval,test}/<class>/`` (the original VLCS
                             release of Fang et al., ICCV 2013): those folders; without
                             ``crossval``, val = seeded stratified 10 % of train; a ``full``
                             folder is ignored when train/test are there.  Flat
                             ``<Domain>/<class>/`` (DomainBed's copy) or only ``full``: seeded
                             stratified 70/10/20 (mpifl choice).
``domainnet``       224      with ``<domain>_train.txt`` / ``<domain>_test.txt`` (the official
                             lists of Peng et al., ICCV 2019; labels 0-based): train and test from
                             the lists, val = seeded stratified 10 % of the train list (mpifl
                             choice; DomainNet has no val).  Without the lists: 70/10/20 seeded.
                             At 224 px the 586k images take about 88 GB; pass ``--size`` to shrink.
``domainnet10``     256      DomainNet restricted to FedBN's 10 classes (other class folders and
                             list lines are skipped), same splits as ``domainnet``; 256 px as in
                             FedBN.  FedBN's own split ships only as pickles.
==================  =======  =====================================================================

Class ids are the sorted class names (Python string order), the same in
every domain; every class must have images in every domain.  Domain ids
have no spaces (Office-Home's ``Real World`` is ``real_world``); the shard's
``source`` attribute keeps the original folder name.  Folder names are
matched as :mod:`mpifl.data.folders` (step 2) says: any case and separators,
plus each spec's aliases (Office-Caltech-10: ``laptop``, Caltech-256's
``003.backpack``; ``caltech10``/``caltech256`` for ``caltech``).
"""

from __future__ import annotations

from typing import Callable

from mpifl.errors import MpiflError
from mpifl.data.folders import Domain, FolderSpec, SplitLists, convert_folders
from mpifl.data.manifest import DatasetManifest

_SEEDED_70 = ("no official split: seeded stratified 70/10/20, an mpifl choice for multi-domain FL "
              "(every client is tested on held-out images of its own domain)")
_VAL_10 = "val: seeded stratified 10 % of the given train split (an mpifl choice)."


def _domains(*entries) -> tuple[Domain, ...]:
    return tuple(Domain(entry[0], tuple(entry[1:]) or (entry[0],)) for entry in entries)


PACS = FolderSpec(
    name="pacs",
    title="PACS (Li et al., ICCV 2017)",
    source="PACS (Li, Yang, Song, Hospedales: Deeper, Broader and Artier Domain Generalization, ICCV 2017)",
    domains=_domains(("art_painting",), ("cartoon",), ("photo",), ("sketch",)),
    classes=("dog", "elephant", "giraffe", "guitar", "horse", "house", "person"),
    default_size=224,
    size_origin="224 px as in gPerXAN's public code (PACS images are 227x227)",
    fractions=(0.7, 0.1, 0.2),
    fractions_origin=("no split lists in --src: seeded stratified 70/10/20, an mpifl choice for multi-domain "
                      "FL (the official lists split each domain ~90/10 train/val and test on a whole "
                      "held-out domain)"),
    lists=SplitLists(files={"train": "{domain}_train_kfold.txt", "val": "{domain}_crossval_kfold.txt",
                            "test": "{domain}_test_kfold.txt"},
                     label_base=1,
                     origin=("official PACS kfold lists (Li et al. 2017): train/crossval ~90/10 of each "
                             "domain; test_kfold is the whole domain (leave-one-domain-out)")),
)

OFFICE_CALTECH = FolderSpec(
    name="office_caltech",
    title="Office-Caltech-10 (Gong et al., CVPR 2012)",
    source=("Office-Caltech-10 (Gong, Shi, Sha, Grauman: Geodesic Flow Kernel for Unsupervised Domain "
            "Adaptation, CVPR 2012): Office-31 and Caltech-256 images of 10 shared classes"),
    domains=_domains(("amazon",), ("caltech", "caltech", "caltech10", "caltech256"), ("dslr",), ("webcam",)),
    classes=("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor",
             "mouse", "mug", "projector"),
    # the names of other copies (e.g. 'laptop') and of Caltech-256's folders (e.g. '127.laptop-101')
    class_aliases={"bike": ("touring_bike",), "keyboard": ("computer_keyboard",),
                   "laptop_computer": ("laptop", "laptop_101"), "monitor": ("computer_monitor",),
                   "mouse": ("computer_mouse",), "mug": ("coffee_mug",), "projector": ("video_projector",)},
    default_size=256,
    size_origin="256x256 as in FedBN's public code (transforms.Resize([256, 256]))",
    fractions=(0.72, 0.08, 0.2),
    fractions_origin=("no official split: seeded stratified 72/8/20 = test 20 % as in FedBN's stratified "
                      "80/20 preprocessing (its Office-Caltech split ships only as pickles), then 10 % of "
                      "the train part as val (FedBN validates on part of its train split)"),
)

OFFICEHOME = FolderSpec(
    name="officehome",
    title="Office-Home (Venkateswara et al., CVPR 2017)",
    source=("Office-Home (Venkateswara, Eusebio, Chakraborty, Panchanathan: Deep Hashing Network for "
            "Unsupervised Domain Adaptation, CVPR 2017)"),
    domains=_domains(("art", "Art"), ("clipart", "Clipart"), ("product", "Product"),
                     ("real_world", "Real World", "Real")),
    num_classes=65,
    default_size=224,
    size_origin="224 px, the usual ImageNet-backbone input (an mpifl choice)",
    fractions=(0.7, 0.1, 0.2),
    fractions_origin=_SEEDED_70,
)

VLCS = FolderSpec(
    name="vlcs",
    title="VLCS (Fang, Xu, Rockmore, ICCV 2013)",
    source=("VLCS (Fang, Xu, Rockmore: Unbiased Metric Learning, ICCV 2013): Caltech101, LabelMe, "
            "PASCAL VOC2007 and SUN09 images of 5 shared classes"),
    domains=_domains(("caltech", "CALTECH", "Caltech101"), ("labelme", "LABELME", "LabelMe"),
                     ("pascal", "PASCAL", "VOC2007"), ("sun", "SUN", "SUN09")),
    num_classes=5,
    default_size=224,
    size_origin="224 px, the usual ImageNet-backbone input (an mpifl choice)",
    fractions=(0.7, 0.1, 0.2),
    fractions_origin=_SEEDED_70,
    split_dirs=True,
    split_dirs_origin="the train/crossval/test folders of the original VLCS release (Fang et al. 2013).",
    val_origin=_VAL_10,
    layout="<DOMAIN>/<class>/<image> or <DOMAIN>/{train,crossval,test}/<class>/<image>",
)

_DOMAINNET_DOMAINS = _domains(("clipart",), ("infograph",), ("painting",), ("quickdraw",), ("real",),
                              ("sketch",))
_DOMAINNET_LISTS = SplitLists(files={"train": "{domain}_train.txt", "test": "{domain}_test.txt"},
                              label_base=0,
                              origin="official DomainNet train/test lists (Peng et al. 2019).")
_DOMAINNET_SOURCE = ("DomainNet (Peng, Bai, Xia, Huang, Saenko, Wang: Moment Matching for Multi-Source "
                     "Domain Adaptation, ICCV 2019)")

DOMAINNET = FolderSpec(
    name="domainnet",
    title="DomainNet (Peng et al., ICCV 2019)",
    source=_DOMAINNET_SOURCE,
    domains=_DOMAINNET_DOMAINS,
    num_classes=345,
    default_size=224,
    size_origin="224 px, the usual ImageNet-backbone input (an mpifl choice)",
    fractions=(0.7, 0.1, 0.2),
    fractions_origin=_SEEDED_70,
    lists=_DOMAINNET_LISTS,
    val_origin=_VAL_10,
)

DOMAINNET10 = FolderSpec(
    name="domainnet10",
    title="DomainNet, FedBN's 10-class subset (Peng et al., ICCV 2019; Li et al., ICLR 2021)",
    source=_DOMAINNET_SOURCE + "; the 10 classes used by FedBN (Li et al., ICLR 2021)",
    domains=_DOMAINNET_DOMAINS,
    classes=("bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill",
             "wine_glass", "zebra"),
    subset=True,
    default_size=256,
    size_origin="256x256 as in FedBN's public code (transforms.Resize([256, 256]))",
    fractions=(0.7, 0.1, 0.2),
    fractions_origin=_SEEDED_70,
    lists=_DOMAINNET_LISTS,
    val_origin=_VAL_10 + " FedBN's own split ships only as pickles.",
)

#: The image-folder benchmarks by dataset name.
BENCHMARKS: dict[str, FolderSpec] = {spec.name: spec for spec in
                                     (PACS, OFFICE_CALTECH, OFFICEHOME, VLCS, DOMAINNET, DOMAINNET10)}


def prepare_benchmark(name: str, src, out, size: int | None = None,
                      log: Callable[[str], None] | None = None) -> DatasetManifest:
    """Convert benchmark ``name`` from the download at ``src`` into ``<out>/<name>``."""
    if name not in BENCHMARKS:
        raise MpiflError(f"no image-folder converter for '{name}'; choose from {', '.join(BENCHMARKS)}")
    return convert_folders(BENCHMARKS[name], src, out, size, log=log)
