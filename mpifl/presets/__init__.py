"""Experiment presets: one experiment of a seed paper, its hyperparameters and its reported numbers, as data.

``python -m mpifl.run --preset NAME --algo A`` runs an experiment with the
paper's settings; ``python -m mpifl.run --list-presets`` lists them;
``python -m mpifl.report RUN_DIR`` then prints our per-domain accuracy next
to the paper's, with the difference.

A preset is one YAML file in this directory, ``<name>.yaml``::

    name: fedwon-t1-digits                 # = the file name
    title: one line
    source: {paper: ..., table: "Table 1", file: 000_c60d9075a796b516.txt}
    data: digits                           # an mpifl dataset (mpifl.data.registry.KNOWN_DATASETS)
    model: digitmodel                      # --model
    selection: last                        # the round of ours compared with the paper: last | best
    prepare: python -m mpifl.data prepare digits --src DIR     # how to get the data
    options: {rounds: 100, batch_size: 32, lr: 0.1, ...}       # any config key, every --algo
    overrides: {fedwon: {lr: 0.05}}                            # per --algo, on top of options
    notes: [where mpifl differs from the paper, what the paper leaves open]
    paper:                                 # the paper's rows, accuracies in %
      - method: FedAvg + FedRDN            # the paper's label of the row
        run: {algo: fedavg, aug: fedrdn}   # the config values that make a run this row
        acc: {amazon: 60.93, ..., mean: 69.80}   # per domain (mpifl's domain ids); mean = the paper's average
        std: {amazon: 0.7}                 # optional: the paper's standard deviations
        table: Table 4                     # optional: when the row comes from another table
        scope: personal                    # optional: which of our models the paper's number is (default:
                                           # the run's first evaluated model; held-out domains: global)
    variants:                              # optional: other regimes of the same experiment, same paper rows
      code:                                # --preset NAME:code
        title: one line
        options: {samples_per_client: 62}  # on top of the preset's options (the overrides still come last)
        selection: best                    # optional: in place of the preset's
        notes: [what this regime is and where it comes from]   # after the preset's notes

Precedence (:func:`apply_preset`): defaults < preset < ``--config`` file <
command line.  The algorithm still comes from ``--algo``; a preset names the
methods it has numbers for (:attr:`Preset.algos`), another ``--algo`` runs
with a warning.  Method options (``mu``, ``uniform_weights`` ...) in
``options`` apply only to the algorithms that declare them.  The preset's
name is stored in the run's ``config.json`` (key ``preset``), which is how
``mpifl.report`` finds the paper's numbers.  ``--preset NAME:VARIANT`` runs
one of the preset's variants: the preset with the variant's options on top,
its selection and its notes added, compared with the same paper rows; the
full name is what ``config.json`` keeps.  A leave-one-domain-out preset
(``holdout: all``) lists, per domain, the accuracy on that domain when it
was held out.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from mpifl.errors import MpiflError

PRESET_DIR = Path(__file__).resolve().parent
SELECTIONS = ("last", "best")
VARIANT_SEPARATOR = ":"  # --preset NAME:VARIANT
_TOP_KEYS = {"name", "title", "source", "data", "model", "selection", "prepare", "options", "overrides", "notes",
             "paper", "variants"}
_RESULT_KEYS = {"method", "run", "acc", "std", "table", "scope"}
_VARIANT_KEYS = {"title", "options", "selection", "notes"}
_VARIANT_NAME = re.compile(r"[a-z0-9][a-z0-9.-]*")
_ROUNDS = {"last": "last round", "best": "best-validation round"}


@dataclass(frozen=True)
class PaperResult:
    """One row of a paper's table: a method's accuracy (%) per domain."""

    method: str
    run: dict[str, Any]
    acc: dict[str, float]
    std: dict[str, float] = field(default_factory=dict)
    table: str = ""
    scope: str | None = None  # "global" or "personal"; None: the run's first evaluated model

    @property
    def algo(self) -> str:
        return self.run["algo"]

    @property
    def domains(self) -> list[str]:
        """The domains the row has numbers for (not the mean)."""
        return [d for d in self.acc if d != "mean"]

    def matches(self, config: Mapping[str, Any]) -> bool:
        """Whether a run with this flat configuration (``config.json``) is this row's method."""
        from mpifl.plan.config import RunConfig

        defaults = {f.name: f.default for f in dataclasses.fields(RunConfig) if f.default is not dataclasses.MISSING}
        return all(config.get(k, defaults.get(k)) == v for k, v in self.run.items())


@dataclass(frozen=True)
class Variant:
    """Another regime of a preset's experiment (another training set, weighting or round selection): options on
    top of the preset's, optionally its own selection, and notes that say where the regime comes from."""

    name: str
    title: str
    options: dict[str, Any]
    selection: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Preset:
    name: str
    title: str
    source: dict[str, str]
    data: str
    model: str
    selection: str
    options: dict[str, Any]
    overrides: dict[str, dict[str, Any]]
    results: list[PaperResult]
    notes: list[str] = field(default_factory=list)
    prepare: str = ""
    variants: dict[str, Variant] = field(default_factory=dict)  # offered by the base preset, by name

    @property
    def algos(self) -> list[str]:
        """The algorithms the paper has numbers for, in table order."""
        return list(dict.fromkeys(r.algo for r in self.results))

    @property
    def citation(self) -> str:
        return f"{self.source.get('paper', '?')}, {self.source.get('table', '?')}"

    def values(self, algo: str) -> dict[str, Any]:
        """The preset's configuration values for ``--algo algo`` (flat config keys).

        Method options of ``options`` are kept only when ``algo`` declares them;
        ``overrides[algo]`` comes on top.
        """
        from mpifl.algorithms import all_options, get_algorithm

        declared = {o.name for o in get_algorithm(algo).options}
        method_options = all_options()
        shared = {k: v for k, v in self.options.items() if k not in method_options or k in declared}
        return {"data": self.data, "model": self.model, **shared, **self.overrides.get(algo, {}),
                "preset": self.name}

    def with_variant(self, name: str) -> Preset:
        """This preset run as its variant ``name``: ``NAME:VARIANT``, the variant's options over the preset's,
        its selection if it names one, its notes after the preset's; the paper rows are the same."""
        if name not in self.variants:
            offered = ", ".join(f"{self.name}{VARIANT_SEPARATOR}{v}" for v in self.variants)
            raise MpiflError(f"preset {self.name} has no variant '{name}'; "
                             + (f"its variants: {offered}" if offered else "it has no variants")
                             + f", or run --preset {self.name}")
        variant = self.variants[name]
        return dataclasses.replace(self, name=f"{self.name}{VARIANT_SEPARATOR}{name}",
                                   title=f"{self.title} [{variant.title}]",
                                   options={**self.options, **variant.options},
                                   selection=variant.selection or self.selection,
                                   notes=self.notes + variant.notes, variants={})

    def result_for(self, config: Mapping[str, Any]) -> PaperResult | None:
        """The paper's row for a run's configuration: the matching row with the most conditions."""
        matching = [r for r in self.results if r.matches(config)]
        return max(matching, key=lambda r: len(r.run)) if matching else None


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str) -> Preset:
    """The preset ``name``, or ``NAME:VARIANT`` one of its variants (a one-line :class:`MpiflError` when it does not
    exist or is malformed)."""
    name, separator, variant = name.partition(VARIANT_SEPARATOR)
    preset = _load(name)
    return preset.with_variant(variant) if separator else preset


def variant_names() -> list[str]:
    """Every preset variant, as ``--preset`` takes it (``NAME:VARIANT``)."""
    return [f"{p.name}{VARIANT_SEPARATOR}{v}" for p in all_presets() for v in p.variants]


def _load(name: str) -> Preset:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise MpiflError(f"unknown preset '{name}'; see `python -m mpifl.run --list-presets` for the "
                         f"{len(preset_names())} presets")
    import yaml

    try:
        raw = yaml.safe_load(path.read_text())
        return _parse(name, raw)
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        raise MpiflError(f"preset file {path} is malformed: {type(exc).__name__}: {str(exc).splitlines()[0]}")


def all_presets() -> list[Preset]:
    return [load_preset(n) for n in preset_names()]


def _parse(name: str, raw: dict) -> Preset:
    if not isinstance(raw, dict):
        raise ValueError("the file must hold a mapping")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    if raw["name"] != name:
        raise ValueError(f"name {raw['name']!r} differs from the file name {name!r}")
    selection = raw.get("selection", "last")
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    results = []
    for row in raw["paper"]:
        extra = set(row) - _RESULT_KEYS
        if extra:
            raise ValueError(f"unknown keys {sorted(extra)} in paper row {row.get('method')!r}")
        if "algo" not in row["run"]:
            raise ValueError(f"paper row {row['method']!r} has no run.algo")
        if row.get("scope") not in (None, "global", "personal"):
            raise ValueError(f"paper row {row['method']!r}: scope must be global or personal")
        results.append(PaperResult(method=str(row["method"]), run=dict(row["run"]),
                                   acc={str(k): float(v) for k, v in row["acc"].items()},
                                   std={str(k): float(v) for k, v in (row.get("std") or {}).items()},
                                   table=str(row.get("table", "")), scope=row.get("scope")))
    return Preset(name=name, title=str(raw["title"]), source=dict(raw["source"]), data=str(raw["data"]),
                  model=str(raw["model"]), selection=selection, options=dict(raw.get("options") or {}),
                  overrides={str(k): dict(v) for k, v in (raw.get("overrides") or {}).items()},
                  results=results, notes=[str(n) for n in raw.get("notes") or []],
                  prepare=str(raw.get("prepare", "")),
                  variants={str(k): _parse_variant(str(k), v) for k, v in (raw.get("variants") or {}).items()})


def _parse_variant(name: str, raw: dict) -> Variant:
    if not _VARIANT_NAME.fullmatch(name):
        raise ValueError(f"variant name {name!r} must be lower-case letters, digits, '.' and '-'")
    if not isinstance(raw, dict):
        raise ValueError(f"variant {name!r} must be a mapping")
    extra = set(raw) - _VARIANT_KEYS
    if extra:
        raise ValueError(f"unknown keys {sorted(extra)} in variant {name!r}")
    if not raw.get("options"):
        raise ValueError(f"variant {name!r} has no options")
    selection = raw.get("selection")
    if selection not in (None, *SELECTIONS):
        raise ValueError(f"variant {name!r}: selection must be one of {SELECTIONS}, got {selection!r}")
    return Variant(name=name, title=str(raw["title"]), options=dict(raw["options"]), selection=selection,
                   notes=[str(n) for n in raw.get("notes") or []])


def apply_preset(name: str | None, algo: str, file_values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``file_values`` with preset ``name``'s values underneath (defaults < preset < file < command line),
    and the warnings to print; ``name`` None: no preset."""
    if not name:
        return file_values, []
    preset = load_preset(name)
    warnings = []
    if algo not in preset.algos:
        warnings.append(f"--preset {name} has no paper numbers for --algo {algo} (it has: "
                        f"{', '.join(preset.algos)}); running with the preset's settings anyway")
    return {**preset.values(algo), **file_values}, warnings


def describe_presets() -> str:
    """The ``--list-presets`` text: one block per preset."""
    lines = []
    for preset in all_presets():
        opts = ", ".join(f"{k}={v}" for k, v in preset.options.items())
        lines += [f"{preset.name}: {preset.title}",
                  f"    source:  {preset.citation}",
                  f"    data:    {preset.data} (model {preset.model}); {opts}",
                  f"    methods: {', '.join(preset.algos)}"]
        if preset.overrides:
            lines.append("    per --algo: " + "; ".join(
                f"{a}: " + ", ".join(f"{k}={v}" for k, v in o.items()) for a, o in preset.overrides.items()))
        lines.append(f"    compares: our {_ROUNDS[preset.selection]} with the paper's")
        for variant in preset.variants.values():
            changes = ", ".join(f"{k}={v}" for k, v in variant.options.items())
            selection = f"; compares our {_ROUNDS[variant.selection]}" if variant.selection else ""
            lines.append(f"    variant {preset.name}{VARIANT_SEPARATOR}{variant.name}: {variant.title} "
                         f"({changes}{selection})")
    lines.append("")
    lines.append("run one with e.g. `mpirun -n 3 python -m mpifl.run --preset NAME --algo fedavg`, then "
                 "`python -m mpifl.report RUN_DIR` prints ours next to the paper's numbers; --preset NAME:VARIANT runs "
                 "a variant")
    return "\n".join(lines)


__all__ = ["PRESET_DIR", "VARIANT_SEPARATOR", "PaperResult", "Preset", "Variant", "all_presets", "apply_preset",
           "describe_presets", "load_preset", "preset_names", "variant_names"]
