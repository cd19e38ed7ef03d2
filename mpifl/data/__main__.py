"""``python -m mpifl.data``: prepare, describe and verify datasets.

* ``prepare NAME [--src DIR] [--data-root ROOT] [--size PX] [--replace]`` builds ``ROOT/NAME``
  (``--severity 1..5`` too for ``cifar10c``); a build of other images already there is replaced only with
  ``--replace`` (:mod:`mpifl.data.staging`);
* ``info NAME [--data-root ROOT]`` prints what a dataset holds;
* ``verify NAME [--data-root ROOT]`` re-checks every shard (sha256 included),
  printing ``ok`` or the problems (exit code 1).

User errors print one line, ``mpifl: error: <message>``, and exit with 2.  The data root was once ``--out``
(``prepare``) and ``--root`` (``info``, ``verify``): those spellings still work, each saying so once on stderr.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import click

from mpifl.errors import MpiflError, OneLine
from mpifl.data.benchmarks import BENCHMARKS, prepare_benchmark
from mpifl.data.camelyon import prepare_camelyon17
from mpifl.data.cifar import prepare_cifar10, prepare_cifar10c
from mpifl.data.digits import prepare_digits
from mpifl.data.fairface import prepare_fairface
from mpifl.data.generated import generate_styledigits
from mpifl.data.shapes import generate_styleshapes
from mpifl.data.isic import prepare_isic2019
from mpifl.data.prostate import prepare_prostate
from mpifl.data.manifest import GENERATED, DatasetManifest, verify
from mpifl.data.registry import KNOWN_DATASETS, default_data_root, ensure_dataset
from mpifl.data.staging import REPLACING, check_replacing


def _prepare_styledigits(src: Path | None, out: Path, size: int | None) -> DatasetManifest:
    if src is not None or size is not None:
        raise MpiflError("styledigits is generated (28 px, no source); drop --src and --size")
    return generate_styledigits(out)


def _prepare_styleshapes(src: Path | None, out: Path, size: int | None) -> DatasetManifest:
    if src is not None or size is not None:
        raise MpiflError("styleshapes is generated (32 px, no source); drop --src and --size")
    return generate_styleshapes(out)


def _prepare_folders(name: str, src: Path | None, out: Path, size: int | None) -> DatasetManifest:
    """An image-folder benchmark (see :mod:`mpifl.data.benchmarks`); progress and timing go to stderr."""
    return prepare_benchmark(name, src, out, size, log=lambda line: click.echo(line, err=True))


def _stderr(line: str) -> None:
    click.echo(line, err=True)


def _prepare_digits(src: Path | None, out: Path, size: int | None) -> DatasetManifest:
    """Digits-Five (see :mod:`mpifl.data.digits`); found/missing domains and progress go to stderr."""
    return prepare_digits(src, out, size, log=_stderr)


#: Converters: dataset name -> function(src, out, size) that writes ``out/<name>``.
PREPARERS = {"styledigits": _prepare_styledigits, "styleshapes": _prepare_styleshapes,
             **{name: functools.partial(_prepare_folders, name) for name in BENCHMARKS},
             "digits": _prepare_digits,
             "cifar10": lambda src, out, size: prepare_cifar10(src, out, size, log=_stderr),
             "cifar10c": lambda src, out, size, severity=None: prepare_cifar10c(src, out, size, severity,
                                                                                log=_stderr),
             "camelyon17": lambda src, out, size: prepare_camelyon17(src, out, size, log=_stderr),
             "isic2019": lambda src, out, size: prepare_isic2019(src, out, size, log=_stderr),
             "prostate": lambda src, out, size: prepare_prostate(src, out, size, log=_stderr),
             "fairface": lambda src, out, size: prepare_fairface(src, out, size, log=_stderr)}
#: Converters that take options beyond --src/--size/--data-root: dataset name -> option names.
EXTRA_OPTIONS = {"cifar10c": ("severity",)}


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MpiflError as e:
            raise OneLine(str(e), e.exit_code) from None


class _Renamed(click.Command):
    """A command that still reads the old spellings of its options (``renamed``: old -> new), saying once that
    each changed."""

    def __init__(self, *args, renamed: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.renamed = renamed

    def parse_args(self, ctx, args):
        said, spelled = set(), []
        for index, arg in enumerate(args):
            if arg == "--":  # the rest are arguments, not options
                return super().parse_args(ctx, spelled + args[index:])
            name, equals, value = arg.partition("=")
            if name in self.renamed:
                if name not in said:
                    said.add(name)
                    click.echo(f"mpifl: notice: {name} is now {self.renamed[name]} (the old spelling still works)",
                               err=True)
                arg = self.renamed[name] + equals + value
            spelled.append(arg)
        return super().parse_args(ctx, spelled)


def _root(value) -> Path:
    return Path(value) if value is not None else default_data_root()


def _data_root_option(what: str = "data root"):
    return click.option("--data-root", type=click.Path(file_okay=False), default=None,
                        help=f"{what} [default: $MPIFL_DATA_ROOT or ./datasets]")


@click.group(cls=_Group)
def cli():
    """Prepare, inspect and verify mpifl datasets (HDF5 shards + manifest.json)."""


@cli.command(cls=_Renamed, renamed={"--out": "--data-root"})
@click.argument("name")
@click.option("--src", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="the dataset as downloaded (converters only)")
@_data_root_option("data root to write NAME/ into")
@click.option("--size", type=click.IntRange(min=1), default=None,
              help="image side in pixels [default: the converter's]")
@click.option("--severity", type=click.IntRange(1, 5), default=None,
              help="cifar10c only: corruption severity 1..5 [default: 5]")
@click.option("--replace", is_flag=True,
              help="replace a build of NAME under the data root that differs from this one (other images): runs "
                   "checkpointed on it can then no longer resume [default: refuse]")
def prepare(name, src, data_root, size, severity, replace):
    """Build dataset NAME under the data root."""
    out = _root(data_root)
    if name not in PREPARERS:
        if name in KNOWN_DATASETS:
            raise MpiflError(f"the converter for '{name}' is not available in this version; "
                             f"copy a prepared shard directory (manifest.json + <domain>.h5) to {out / name}")
        raise MpiflError(f"unknown dataset '{name}'; preparable: {', '.join(PREPARERS)}")
    extra = {k: v for k, v in {"severity": severity}.items() if v is not None}
    for option in extra:
        if option not in EXTRA_OPTIONS.get(name, ()):
            users = [n for n, options in EXTRA_OPTIONS.items() if option in options]
            raise MpiflError(f"--{option} does not apply to {name} (only to {', '.join(users)}); drop it")
    token = REPLACING.set(replace)
    try:
        if name not in GENERATED:
            check_replacing(out / name, size)
        manifest = PREPARERS[name](src, out, size, **extra)
    finally:
        REPLACING.reset(token)
    images = sum(sum(sizes.values()) for sizes in manifest.splits.values())
    click.echo(f"{name}: ready at {out / name} ({len(manifest.domains)} domains, {images} images)")


@cli.command(cls=_Renamed, renamed={"--root": "--data-root"})
@click.argument("name")
@_data_root_option()
def info(name, data_root):
    """Describe dataset NAME: domains, classes, image size, split sizes, normalization."""
    root = _root(data_root)
    m = ensure_dataset(root, name)
    shown = " ".join(m.classes[:20]) + (f" ... ({m.num_classes - 20} more)" if m.num_classes > 20 else "")
    click.echo(f"dataset    {m.name}  ({root / m.name})")
    click.echo(f"source     {m.source}")
    click.echo(f"classes    {m.num_classes}: {shown}")
    click.echo(f"images     {m.image_size[0]}x{m.image_size[1]}x{m.channels} uint8")
    click.echo(f"normalize  mean {_floats(m.normalize['mean'])}  std {_floats(m.normalize['std'])}")
    click.echo(f"protocol   {json.dumps(m.protocol)}")
    width = max(len("domain"), *(len(d) for d in m.domains))
    click.echo(f"{'domain':<{width}}  {'train':>7} {'val':>7} {'test':>7} {'bytes':>12}")
    for d in m.domains:
        s = m.splits[d]
        click.echo(f"{d:<{width}}  {s['train']:>7} {s['val']:>7} {s['test']:>7} {m.shards[d]['bytes']:>12}")
    totals = [sum(m.splits[d][k] for d in m.domains) for k in ("train", "val", "test")]
    nbytes = sum(m.shards[d]["bytes"] for d in m.domains)
    click.echo(f"{'total':<{width}}  {totals[0]:>7} {totals[1]:>7} {totals[2]:>7} {nbytes:>12}")


def _floats(values) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


@cli.command(name="verify", cls=_Renamed, renamed={"--root": "--data-root"})
@click.argument("name")
@_data_root_option()
def verify_command(name, data_root):
    """Re-check every shard of NAME against its manifest, checksums included."""
    problems = verify(_root(data_root), name)
    for problem in problems:
        click.echo(problem)
    if problems:
        raise SystemExit(1)
    click.echo("ok")


if __name__ == "__main__":
    cli(prog_name="python -m mpifl.data")
