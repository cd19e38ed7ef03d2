"""The generic image-folder converter: ``<domain>/<class>/<image>`` trees into shards.

Every image-folder benchmark (PACS, Office-Caltech-10, Office-Home, VLCS,
DomainNet; see :mod:`mpifl.data.benchmarks`) is one :class:`FolderSpec` fed
to :func:`convert_folders`.  The conversion is the same for all of them:

1. **Scan and check** everything before decoding a single pixel: one folder
   per domain, class folders inside it (optionally below a lone ``images/``
   folder, as in Office-31 downloads), image files inside those (``.jpg
   .jpeg .png .bmp .gif .ppm .pgm .tif .tiff .webp``, any case; other files
   such as ``Thumbs.db`` are skipped).  Hidden folders and folders holding
   neither sub-folders nor images, such as a folder of split lists, are
   ignored.
2. **Names**: domain and class folders (and the class names in split lists)
   are matched against the spec's canonical names and aliases by
   :func:`mpifl.data.names.folder_key`: case, ``-``/``_``/blank separators
   and a Caltech-256 number prefix do not count (``Art-Painting`` is
   ``art_painting``, ``backpack`` is ``back_pack``), and aliases cover other
   words (Office-Caltech's ``laptop`` is ``laptop_computer``).  Each mapping
   is logged once (``class folder 'backpack' -> back_pack``); the shards and
   the manifest use the canonical names only.  A folder that matches nothing
   is an error naming it and the accepted names.
3. **Classes**: the spec's fixed list, or the sorted union of the class
   folders found (spellings that :func:`~mpifl.data.names.folder_key` makes
   equal are one class, named as most domains spell it); class ids are the
   positions in that sorted list (Python string order), the same in every
   domain.  A class with no images in some domain is an error naming the
   domain and the class.
4. **Splits**, in this order of preference:

   * split lists in ``--src`` (or one folder below it), e.g. PACS's
     ``<domain>_train_kfold.txt``: lines ``<domain>/<class>/<file> <label>``;
     rows keep the list order.  Every listed file must exist, a class must
     always carry the same label, labels must lie in range and a domain's
     lists must use as many labels as it has classes, else the lists do not
     belong to these folders.  Images named by no list are left out.
   * split folders, e.g. VLCS's ``<domain>/{train,crossval,test}/<class>``.
   * a seeded stratified split: per domain and class, the class's files
     (sorted by name) are permuted by a generator seeded from
     ``(SPLIT_SEED, dataset, domain, class)`` and cut at the cumulative
     fractions (rounded half up), so every class is split in the same
     proportions and the split of one class never depends on the others.

   When lists or folders give train and test but no val, val is a seeded
   stratified fraction (``FolderSpec.val_fraction``) of the train rows.
   Rows of a seeded split are written sorted by class, then file name.
5. **Decode and write**: every image decoded to RGB and resized once to
   ``S x S`` (:mod:`mpifl.data.images`), a thread pool at most two batches
   ahead of the HDF5 writer, so memory stays bounded whatever the domain's
   size.
6. **Atomic result**: shards and ``manifest.json`` are written into a
   temporary folder under ``--data-root`` that is renamed onto ``<out>/<name>``
   only when everything succeeded (replacing an earlier prepared copy, never
   a folder holding anything else); on any error or interrupt the temporary
   folder is deleted, so no shard is left behind.

Steps 5 and 6 are :func:`mpifl.data.listed.write_listed`, shared with the
converters of image files listed in a CSV table; the seeded splits of step 4
are :mod:`mpifl.data.splits`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mpifl.errors import MpiflError
from mpifl.data.images import RESIZE_NOTE
from mpifl.data.links import check_link
from mpifl.data.listed import ListedDomain, write_listed
from mpifl.data.manifest import DatasetManifest
from mpifl.data.names import MATCHING, Aliases, folder_key
from mpifl.data.shard import SPLITS
from mpifl.data.splits import SPLIT_SEED, split_rows, stratified_split
from mpifl.data.staging import check_target

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff",
                              ".webp"})
_SPLIT_DIR_NAMES = {"train": ("train",), "val": ("crossval", "val"), "test": ("test",), "full": ("full",)}


@dataclass(frozen=True)
class Domain:
    """A domain: its id (the shard's file stem, no spaces) and the folder names it is found under."""

    id: str
    folders: tuple[str, ...]


@dataclass(frozen=True)
class SplitLists:
    """Per-domain split list files: ``files`` maps split -> name template with ``{domain}``.

    ``label_base`` is the label of the first class in the lists (0 or 1).
    """

    files: dict
    label_base: int
    origin: str


@dataclass(frozen=True)
class FolderSpec:
    """What differs between image-folder benchmarks; everything else is :func:`convert_folders`.

    ``classes`` is the fixed class list (``None``: discover the class folders,
    expecting ``num_classes`` of them); ``class_aliases`` maps a class to the
    other folder names it is found under.  With ``subset``, class folders
    outside ``classes`` are skipped instead of rejected.  ``fractions`` is the
    seeded train/val/test split used when neither ``lists`` nor
    ``split_dirs`` apply; ``val_fraction`` carves val out of a given train
    split that comes without val.  ``*_origin`` say where the choices come
    from (they go into the manifest's ``protocol``).
    """

    name: str
    title: str
    domains: tuple[Domain, ...]
    default_size: int
    source: str
    classes: tuple[str, ...] | None = None
    class_aliases: dict = field(default_factory=dict)
    num_classes: int | None = None
    subset: bool = False
    allow_missing_classes: bool = False
    fractions: tuple[float, float, float] = (0.7, 0.1, 0.2)
    fractions_origin: str = ""
    lists: SplitLists | None = None
    split_dirs: bool = False
    split_dirs_origin: str = ""
    val_fraction: float = 0.1
    val_origin: str = ""
    size_origin: str = ""
    layout: str = "<domain>/<class>/<image>"

    def __post_init__(self):
        if abs(sum(self.fractions) - 1.0) > 1e-9 or min(self.fractions) < 0:
            raise ValueError(f"{self.name}: split fractions {self.fractions} must be >= 0 and sum to 1")
        if self.lists is not None and self.split_dirs:
            raise ValueError(f"{self.name}: give split lists or split folders, not both")
        if self.classes is not None and list(self.classes) != sorted(set(self.classes)):
            raise ValueError(f"{self.name}: the class list must be sorted and unique")
        if set(self.class_aliases) - set(self.classes or ()):
            raise ValueError(f"{self.name}: class aliases name classes outside the class list")
        self.domain_names, self.fixed_class_names  # building them raises ValueError on a name clash

    @property
    def domain_names(self) -> Aliases:
        return Aliases({d.id: d.folders for d in self.domains})

    @property
    def fixed_class_names(self) -> Aliases | None:
        if self.classes is None:
            return None
        return Aliases({c: tuple(self.class_aliases.get(c, ())) for c in self.classes})


@dataclass
class DomainPlan:
    """One domain's scanned source: its folder and the (path, label) rows of each split."""

    domain: Domain
    folder: Path
    rows: dict = field(default_factory=dict)  # split -> list[(Path, int)]
    rule: str = ""
    overlap: bool = False
    skipped: int = 0  # images on disk named by no split list


def _carve_val(spec: FolderSpec, domain: Domain, train: list, classes: list) -> tuple[list, list]:
    """Split given train rows into (train, val): a seeded stratified ``val_fraction`` per class.

    Both parts keep the rows' given order.
    """
    kept, val = split_rows(train, classes, (1 - spec.val_fraction, spec.val_fraction),
                           (spec.name, domain.id, "val"))
    return kept, val


# ---------------------------------------------------------------- scanning


def _visible_dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))


def _is_image(path: Path) -> bool:
    """Whether ``path`` is an image file, by its name; one line for an image whose symbolic link leads nowhere
    (skipped, it would change the dataset without a word)."""
    if path.suffix.lower() not in IMAGE_EXTENSIONS or path.name.startswith("."):
        return False
    check_link(path, "image")
    return path.is_file()


def _holds_data(path: Path) -> bool:
    """Whether an unmatched folder looks like data (sub-folders or images), not e.g. split lists."""
    return any(p.is_dir() and not p.name.startswith((".", "__")) or _is_image(p) for p in path.iterdir())


def _scan_classes(folder: Path) -> dict[str, list[Path]]:
    """Class folder name -> its image files (sorted by name) in ``folder``."""
    dirs = _visible_dirs(folder)
    if [d.name.lower() for d in dirs] == ["images"] and not any(_is_image(p) for p in folder.iterdir()):
        return _scan_classes(dirs[0])
    tree = {}
    for class_dir in dirs:
        images = []
        for p in sorted(class_dir.iterdir()):
            if p.is_dir() and not p.name.startswith((".", "__")):
                raise MpiflError(f"unexpected folder {p} inside a class folder; class folders hold "
                                 "image files only: move its images up or remove it")
            if _is_image(p):
                images.append(p)
        tree[class_dir.name] = images
    return tree


def _domain_folders(spec: FolderSpec, src: Path, mapped: dict) -> dict[str, Path]:
    """Domain id -> its folder in ``src``; unknown data folders and missing domains are errors."""
    names = spec.domain_names
    found: dict[str, Path] = {}
    for folder in _visible_dirs(src):
        domain = names.resolve(folder.name)
        if domain is None:
            if _holds_data(folder):
                raise MpiflError(f"unknown domain folder '{folder.name}' in {src}; {spec.name} accepts "
                                 f"{names.accepted()} ({MATCHING}): point --src at the folder holding the "
                                 "domain folders, or move the extra folder away")
            continue
        if domain in found:
            raise MpiflError(f"two folders for domain {domain} in {src}: '{found[domain].name}' and "
                             f"'{folder.name}'; keep one")
        found[domain] = folder
        if folder.name != domain:
            mapped[f"domain folder '{folder.name}' -> {domain}"] = None
    for domain in spec.domains:
        if domain.id not in found:
            raise MpiflError(f"no folder for domain '{domain.folders[0]}' in {src}; {spec.name} expects "
                             f"{spec.layout} with domains {', '.join(d.folders[0] for d in spec.domains)}")
    return {d.id: found[d.id] for d in spec.domains}


def _split_dir_layout(folder: Path) -> dict[str, Path] | None:
    """VLCS-style split folders of a domain folder (split -> folder), or None for a class tree."""
    dirs = _visible_dirs(folder)
    names = {alias: split for split, aliases in _SPLIT_DIR_NAMES.items() for alias in aliases}
    matched = {d: names.get(d.name.lower()) for d in dirs}
    if not any(matched.values()):
        return None
    others = [d.name for d, split in matched.items() if split is None]
    if others:
        raise MpiflError(f"{folder} mixes split folders with other folders ({', '.join(others)}); "
                         "use either <domain>/<class>/ or <domain>/{train,crossval,test}/<class>/")
    layout: dict[str, Path] = {}
    for d, split in matched.items():
        if split in layout:
            raise MpiflError(f"{folder} has two {split} folders ('{layout[split].name}', '{d.name}'); "
                             "keep one")
        layout[split] = d
    if ("train" in layout) != ("test" in layout):
        have, lack = ("train", "test") if "train" in layout else ("test", "train")
        raise MpiflError(f"{folder} has a {have} folder but no {lack} folder; add it, or give a single "
                         "'full' folder (or class folders) to get a seeded split")
    if "train" not in layout and "val" in layout:
        raise MpiflError(f"{folder} has a crossval folder without train/test folders; add them")
    return layout


def _find_list(spec: FolderSpec, src: Path, domain: Domain, folder: Path, split: str) -> Path | None:
    """The split list file of ``domain`` in ``src`` or one non-domain folder below it."""
    template = spec.lists.files[split]
    names = {template.format(domain=n) for n in (folder.name, domain.id)}
    places = [src] + [p for p in _visible_dirs(src) if not _is_domain_folder(spec, p)]
    for place in places:
        for name in sorted(names):
            if (place / name).is_file():
                return place / name
    return None


def _is_domain_folder(spec: FolderSpec, path: Path) -> bool:
    return spec.domain_names.resolve(path.name) is not None


def _read_list(spec: FolderSpec, path: Path, domain: Domain, folder: Path, tree: dict,
               class_index: dict, names: Aliases, labels_seen: dict) -> list:
    """Rows (path, class index) of a split list, checked against the (canonically named) class folders."""
    base = spec.lists.label_base
    rows, seen = [], set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MpiflError(f"cannot read split list {path} ({e}); replace it or remove it to get a seeded "
                         "split") from None
    files = {(c, p.name): p for c, paths in tree.items() for p in paths}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"split list {path} line {number}"
        parts = line.strip().rsplit(None, 1)
        try:
            name, label = parts[0].replace("\\", "/"), int(parts[1])
        except (IndexError, ValueError):
            raise MpiflError(f"{where} is not '<domain>/<class>/<file> <label>': {line.strip()!r}; fix the "
                             "line or remove the lists to get a seeded split") from None
        pieces = [p for p in name.split("/") if p not in ("", ".")]
        if len(pieces) < 3 or folder_key(pieces[-3]) not in {folder_key(folder.name), folder_key(domain.id)}:
            raise MpiflError(f"{where} names {name!r}, not a file of domain folder '{folder.name}'; use the "
                             f"lists that belong to {folder}")
        cls, file = names.resolve(pieces[-2]) or pieces[-2], pieces[-1]
        if cls not in class_index:
            if spec.subset:
                continue
            raise MpiflError(f"{where} names class '{cls}', which has no folder in {folder}; the lists do "
                             "not match the folders: use the matching lists or folders")
        if label < base or (not spec.subset and label >= base + len(class_index)):
            raise MpiflError(f"{where}: label {label} is outside {base}..{base + len(class_index) - 1} "
                             f"({len(class_index)} class folders); the lists do not match the folders")
        first = labels_seen.setdefault(("class", cls), (label, where))
        if first[0] != label:
            raise MpiflError(f"{where} gives class '{cls}' label {label}, but {first[1]} gives it label "
                             f"{first[0]}; the lists disagree on labels: fix them")
        other = labels_seen.setdefault(("label", label), (cls, where))
        if other[0] != cls:
            raise MpiflError(f"{where} gives label {label} to class '{cls}', but {other[1]} gives it to "
                             f"'{other[0]}'; the lists disagree on labels: fix them")
        image = files.get((cls, file))
        if image is None:
            raise MpiflError(f"{where} names {name!r}, which is not an image in {folder / cls}; the lists "
                             "do not match the folders: restore the file or use the matching lists")
        if image in seen:
            raise MpiflError(f"{where} repeats {name!r}; remove the duplicate line")
        seen.add(image)
        rows.append((image, class_index[cls]))
    return rows


def _class_names(spec: FolderSpec, trees: dict) -> Aliases:
    """The spec's class names, or for discovered classes the folder names found, one per
    :func:`folder_key`: the spelling most domains use (ties: the first in sorted order)."""
    if spec.fixed_class_names is not None:
        return spec.fixed_class_names
    spellings: dict[str, Counter] = {}
    for tree in trees.values():
        for name in {n for split_tree in tree.values() for n in split_tree}:
            spellings.setdefault(folder_key(name), Counter())[name] += 1
    chosen = {}
    for counts in spellings.values():
        best = min(counts, key=lambda n: (-counts[n], n))
        chosen[best] = tuple(counts)
    return Aliases(dict(sorted(chosen.items())))


def _canonical_tree(spec: FolderSpec, names: Aliases, domain_id: str, folder: Path, tree: dict,
                    mapped: dict) -> dict:
    """``tree`` keyed by canonical class names; a folder matching no class is an error (skipped for a
    subset), two folders of one class too."""
    renamed: dict = {}
    for name, paths in tree.items():
        canonical = names.resolve(name)
        if canonical is None:
            if spec.subset:
                continue
            raise MpiflError(f"unknown class folder '{name}' in {folder} (domain {domain_id}); {spec.name} "
                             f"accepts {names.accepted()} ({MATCHING}): rename or remove it")
        if canonical in renamed:
            raise MpiflError(f"two folders for class {canonical} in {folder}: '{renamed[canonical][0]}' and "
                             f"'{name}'; keep one")
        renamed[canonical] = (name, paths)
        if name != canonical:
            mapped[f"class folder '{name}' -> {canonical}"] = None
    return {c: paths for c, (_, paths) in renamed.items()}


def _check_classes(spec: FolderSpec, domain_id: str, folder: Path, tree: dict, classes: list) -> None:
    if not spec.allow_missing_classes:
        for cls in classes:
            if not tree.get(cls):
                what, fix = (("has no folder", f"restore {folder / cls}") if cls not in tree else
                             ("has an empty folder", f"put its images back into {folder / cls}"))
                raise MpiflError(f"domain {domain_id}: class '{cls}' {what} in {folder}; {spec.name} needs "
                                 f"every class in every domain: {fix}")


def _merge(trees) -> dict:
    merged: dict = {}
    for tree in trees:
        for cls, paths in tree.items():
            merged.setdefault(cls, []).extend(paths)
    return merged


def scan_source(spec: FolderSpec, src, log: Callable[[str], None] | None = None
                ) -> tuple[list[str], list[DomainPlan]]:
    """Check ``src`` against ``spec``; return the class list and each domain's split rows.

    ``log`` receives each folder name mapped to a canonical name, once.
    """
    src = Path(src)
    if not src.is_dir():
        raise MpiflError(f"source folder {src} does not exist; pass --src DIR holding {spec.layout}")
    mapped: dict = {}  # the mapping messages, in order, once each
    folders = _domain_folders(spec, src, mapped)
    layouts = {d: _split_dir_layout(f) if spec.split_dirs else None for d, f in folders.items()}
    trees = {d: ({s: _scan_classes(p) for s, p in layouts[d].items()} if layouts[d]
                 else {"all": _scan_classes(f)}) for d, f in folders.items()}
    names = _class_names(spec, trees)
    trees = {d: {s: _canonical_tree(spec, names, d, layouts[d][s] if layouts[d] else folders[d], tree, mapped)
                 for s, tree in t.items()} for d, t in trees.items()}
    for line in mapped:
        (log or (lambda line: None))(f"{spec.name}: {line}")
    # the classes a domain holds: its class folders, or those of its split folders ('full' only
    # counts when there are no train/test folders)
    merged = {d: _merge(tree for s, tree in t.items() if s != "full" or "train" not in t)
              for d, t in trees.items()}
    if spec.classes is not None:
        classes = list(spec.classes)
    else:
        classes = sorted({c for tree in merged.values() for c, paths in tree.items() if paths})
        if spec.num_classes is not None and len(classes) != spec.num_classes:
            raise MpiflError(f"found {len(classes)} non-empty class folders across the domains of {src}, "
                             f"{spec.name} has {spec.num_classes}; point --src at the complete dataset")
    for d, tree in merged.items():
        _check_classes(spec, d, folders[d], tree, classes)
    index = {c: i for i, c in enumerate(classes)}
    plans = [DomainPlan(domain, folders[domain.id]) for domain in spec.domains]
    labels_seen: dict = {}
    listed = _lists_present(spec, src, plans)
    for plan in plans:
        d = plan.domain.id
        if listed:
            _plan_from_lists(spec, plan, listed[d], trees[d]["all"], index, names, labels_seen)
        elif layouts[d] and "train" in layouts[d]:
            _plan_from_split_dirs(spec, plan, trees[d], index)
        else:
            groups = {c: merged[d][c] for c in classes if merged[d].get(c)}
            parts = stratified_split(groups, spec.fractions, (spec.name, d))
            label = {p: index[c] for c, paths in groups.items() for p in paths}
            plan.rows = {s: [(p, label[p]) for p in part] for s, part in zip(SPLITS, parts)}
            plan.rule = (f"seeded stratified split per domain and class: train/val/test = "
                         f"{'/'.join(f'{100 * f:g}' for f in spec.fractions)} % (seed {SPLIT_SEED})")
    rules = {p.rule for p in plans}
    if len(rules) > 1:
        described = "; ".join(f"{p.domain.id}: {p.rule}" for p in plans)
        raise MpiflError(f"the domains of {src} would be split differently ({described}); give every "
                         "domain the same layout")
    return classes, plans


def _lists_present(spec: FolderSpec, src: Path, plans) -> dict | None:
    """Domain id -> {split: list file} when split lists are given (all or none)."""
    if spec.lists is None:
        return None
    found = {p.domain.id: {s: _find_list(spec, src, p.domain, p.folder, s) for s in spec.lists.files}
             for p in plans}
    present = [(d, s, f) for d, files in found.items() for s, f in files.items() if f is not None]
    if not present:
        return None
    for plan in plans:
        for split, path in found[plan.domain.id].items():
            if path is None:
                have = present[0][2]
                missing = spec.lists.files[split].format(domain=plan.folder.name)
                raise MpiflError(f"split list {missing} is missing next to {have}; give every domain all "
                                 f"its lists ({', '.join(spec.lists.files.values())}) or none for a "
                                 "seeded split")
    return found


def _plan_from_lists(spec, plan: DomainPlan, files: dict, tree: dict, index: dict, names: Aliases,
                     labels_seen) -> None:
    d = plan.domain
    rows = {s: _read_list(spec, path, d, plan.folder, tree, index, names, labels_seen)
            for s, path in files.items()}
    used = {label for split_rows in rows.values() for _, label in split_rows}
    if len(used) != len(index):
        missing = [c for c, i in index.items() if i not in used]
        raise MpiflError(f"the split lists of domain {d.id} ({', '.join(str(f) for f in files.values())}) "
                         f"use {len(used)} labels but {plan.folder} has {len(index)} classes (none listed "
                         f"for '{missing[0]}'); use the lists that belong to these folders")
    names = ", ".join(f"{s} <- {spec.lists.files[s]}" for s in files)
    plan.rule = f"split lists ({names})"
    if "val" not in rows:
        rows["train"], rows["val"] = _carve_val(spec, d, rows["train"], list(index))
        plan.rule += (f"; val = seeded stratified {100 * spec.val_fraction:g} % of the train list "
                      f"(seed {SPLIT_SEED})")
    plan.rows = {s: rows.get(s, []) for s in SPLITS}
    paths = [{p for p, _ in plan.rows[s]} for s in SPLITS]
    plan.overlap = bool(paths[0] & paths[1] or paths[0] & paths[2] or paths[1] & paths[2])
    listed = set().union(*paths)
    plan.skipped = sum(1 for c in index for p in tree.get(c, []) if p not in listed)


def _plan_from_split_dirs(spec, plan: DomainPlan, trees: dict, index: dict) -> None:
    def rows(tree):
        return [(p, index[c]) for c in sorted(tree, key=lambda c: index.get(c, -1))
                if c in index for p in tree[c]]

    plan.rows = {s: rows(trees[s]) if s in trees else [] for s in SPLITS}
    found = "/".join(s for s in ("train", "val", "test") if s in trees)
    plan.rule = f"split folders ({found.replace('val', 'crossval')})"
    if "val" not in trees:
        plan.rows["train"], plan.rows["val"] = _carve_val(spec, plan.domain, plan.rows["train"],
                                                           list(index))
        plan.rule += (f"; val = seeded stratified {100 * spec.val_fraction:g} % of the train folder "
                      f"(seed {SPLIT_SEED})")


# ---------------------------------------------------------------- writing


def _protocol(spec: FolderSpec, plans) -> dict:
    rule = plans[0].rule
    if rule.startswith("split lists"):
        origin = spec.lists.origin + (f" {spec.val_origin}" if "val = seeded" in rule else "")
    elif rule.startswith("split folders"):
        origin = spec.split_dirs_origin + (f" {spec.val_origin}" if "val = seeded" in rule else "")
    else:
        origin = spec.fractions_origin
    protocol = {"clients_per_domain": 1, "split": rule, "split_origin": origin,
                "default_size": spec.default_size, "size_origin": spec.size_origin,
                "resize": RESIZE_NOTE}
    overlapping = [p.domain.id for p in plans if p.overlap]
    if overlapping:
        protocol["test_overlaps_train"] = True
        protocol["note"] = (f"in {', '.join(overlapping)} the lists put some images in more than one split "
                            "(e.g. PACS test_kfold lists the whole domain, for leave-one-domain-out): do not "
                            "use test for in-domain evaluation; convert without the lists for a disjoint "
                            "seeded split")
    return protocol


def convert_folders(spec: FolderSpec, src, out, size: int | None = None,
                    log: Callable[[str], None] | None = None) -> DatasetManifest:
    """Convert the image-folder dataset at ``src`` into ``<out>/<spec.name>``; return its manifest.

    ``size`` is the side of the square images (default ``spec.default_size``);
    ``log`` receives progress lines (per domain: images, split sizes, seconds).
    """
    log = log or (lambda line: None)
    if src is None:
        raise MpiflError(f"{spec.name} is converted from a download: pass --src DIR, the folder holding "
                         f"{spec.layout} ({spec.title})")
    src, out = Path(src), Path(out)
    size = spec.default_size if size is None else int(size)
    if size < 1:
        raise MpiflError(f"image size {size} must be at least 1 pixel; pass --size S with S >= 1")
    check_target(out / spec.name, src)
    started = time.monotonic()
    classes, plans = scan_source(spec, src, log)
    total = sum(len(r) for p in plans for r in p.rows.values())
    log(f"{spec.name}: {len(plans)} domains, {len(classes)} classes, {total} images; {plans[0].rule}")
    domains = [ListedDomain(p.domain.id, f"{spec.title}, domain folder '{p.folder.name}' of "
                                         f"{p.folder.parent.resolve()}; {p.rule}", p.rows,
                            shown=f" (from '{p.folder.name}')",
                            note=f", {p.skipped} images in no list left out" if p.skipped else "")
               for p in plans]
    return write_listed(spec.name, src, out, domains, classes, size, spec.source, _protocol(spec, plans),
                        log, started)
