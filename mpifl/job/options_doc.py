"""``docs/options.md``, generated from the command line itself, so that the page cannot drift from ``--help``.

:func:`options_markdown` walks the parameters of :func:`mpifl.job.cli.command` (core options, every method's own
options, the command-level flags) and renders each as click's ``--help`` shows it: its flags and metavar, its
help text, its default.  A run option goes to its ``group``, groups and rows in the order of
:data:`mpifl.plan.config.RUN_OPTIONS`, the command's own flags after the run options of theirs (:data:`COMMAND_FLAGS`);
a method's option to the methods' group, as its help names the methods that take it (``[fedprox; default 0.01]``);
any other under "Other options", so a new option always appears.  Regenerate the page with::

    python -m mpifl.job.options_doc > docs/options.md

``tests/job/test_options_doc.py`` fails when the committed page differs from what this module builds.
"""

from __future__ import annotations

import contextlib
import os
import re

import click

from mpifl.job.cli import command
from mpifl.plan.config import RUN_OPTIONS, Option

REGENERATE = "python -m mpifl.job.options_doc > docs/options.md"

INTRO = f"""\
# Options of `python -m mpifl.run`

This page is generated from the command line's own help (`python -m mpifl.run --help`) by
`mpifl/job/options_doc.py`; do not edit it by hand. After changing an option, its help text or a method's
options, regenerate it with `{REGENERATE}`
(`tests/job/test_options_doc.py` fails until the page matches).
Options merge in this order: defaults < `--preset` < `--config` < the command line. A method's own options
(the last group) name the methods that take them and their defaults; given with another `--algo`, such an
option has no effect and the run warns so. [The README](../README.md) shows the common commands;
[design.md](design.md), [faults.md](faults.md) and [methods.md](methods.md) explain what the options act on.
"""

#: The command's own flags, which are no run option: the group each joins, after that group's run options.
INFO = "Information, then exit"
COMMAND_FLAGS = {"--config": "Method, experiment and seed", "--resume": "Run directory, checkpoints and failures",
                 "--show-manifest": INFO, "--version": INFO, "--list-presets": INFO, "--help": INFO}
METHODS = "Options of the methods"
OTHER = "Other options"

_CLICK_EXTRA = re.compile(r"\s{2}\[([^\[\]]*)\]$")  # what click appends to a help text: "  [default: 10]"
_NAMES_METHODS = re.compile(r"\[[^\[\]]*\bdefault\b[^\[\]]*\]$")  # cli's "[fedprox; default 0.01]"


def _cell(text: str) -> str:
    """One table cell: one line, with the characters Markdown would take for table or HTML syntax escaped."""
    text = " ".join(text.split())
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def _code(text: str) -> str:
    """Inline code for a cell: `` `...` `` (inside code only ``|`` needs escaping in a table)."""
    return "`" + " ".join(text.split()).replace("|", "\\|") + "`"


def _long_flags(param: click.Parameter) -> list[str]:
    return [o for o in param.opts + param.secondary_opts if o.startswith("--")]


def _row(param: click.Parameter, ctx: click.Context) -> tuple[str, str, str] | None:
    """(flags with metavar, default as click shows it, help) of one parameter, or None for a hidden one."""
    record = param.get_help_record(ctx)
    if record is None:
        return None
    flags, text = record
    default = ""
    extra = _CLICK_EXTRA.search(text)
    if extra:
        text = text[:extra.start()]
        default = "; ".join(p.split(": ", 1)[1] if p.startswith("default: ") else p for p in extra[1].split("; "))
    return flags, default, text


def _group_of(param: click.Parameter, text: str, groups: dict[str, str]) -> str:
    for flag in _long_flags(param):
        if flag in groups:
            return groups[flag]
    return METHODS if _NAMES_METHODS.search(text) else OTHER


@contextlib.contextmanager
def _environment_defaults():
    """Build the command as on a machine with no ``MPIFL_DATA_ROOT``: the ``--data-root`` default it shows
    comes from that variable, and the page must not depend on who generates it."""
    saved = os.environ.pop("MPIFL_DATA_ROOT", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["MPIFL_DATA_ROOT"] = saved


def options_markdown(options: tuple[Option, ...] = RUN_OPTIONS) -> str:
    """The whole page, ``docs/options.md``, of the command with these run ``options``."""
    with _environment_defaults():
        cmd = command(options)
    ctx = click.Context(cmd, info_name="python -m mpifl.run", **cmd.context_settings)
    params = list(cmd.params)
    help_option = cmd.get_help_option(ctx)
    if help_option is not None:
        params.append(help_option)
    groups = {**{o.flag: o.group for o in options}, **COMMAND_FLAGS}
    rows: dict[str, list[tuple[str, str, str]]] = {}
    for param in params:
        row = _row(param, ctx)
        if row is not None:
            rows.setdefault(_group_of(param, row[2], groups), []).append(row)
    order = [*dict.fromkeys(groups.values()), METHODS, OTHER]
    present = [title for title in order if title in rows]
    parts = [INTRO]
    if cmd.help:
        parts.append(f"The command, as its `--help` describes it: {_cell(cmd.help)}\n")
    parts.append("Groups: " + ", ".join(f"[{title}](#{_anchor(title)})" for title in present) + ".\n")
    for title in present:
        parts.append(_methods_table(rows[title]) if title == METHODS else _table(title, rows[title]))
    return "\n".join(parts)


def _table(title: str, rows: list[tuple[str, str, str]]) -> str:
    """A group of run options (and the command's own flags that join it)."""
    return (f"## {title}\n\n| option | default | meaning |\n| --- | --- | --- |\n"
            + "".join(f"| {_code(flags)} | {_code(default) if default else ''} | {_cell(text)} |\n"
                      for flags, default, text in rows))


def _methods_table(rows: list[tuple[str, str, str]]) -> str:
    """The methods' own options, as the command has them, with the methods taking each and their defaults."""
    return (f"## {METHODS}\n\n| option | methods; default | meaning |\n| --- | --- | --- |\n"
            + "".join(f"| {_code(flags)} | {_cell(taken)} | {_cell(text)} |\n"
                      for flags, taken, text in map(_split_methods, rows)))


def _split_methods(row: tuple[str, str, str]) -> tuple[str, str, str]:
    """A method option's row: (flags, the methods taking it and their defaults, the help before that list)."""
    flags, _, text = row
    taken = _NAMES_METHODS.search(text)
    return flags, taken[0][1:-1], text[:taken.start()].rstrip()


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, blanks as ``-``."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


if __name__ == "__main__":
    print(options_markdown(), end="")
