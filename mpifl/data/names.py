"""The names a dataset gives things, checked wherever a manifest or a shard is read or written: a domain's
name becomes a file (``<domain>.h5``) and a folder (``holdout-<domain>/``), so it must be one plain file-name
component; a class name is shown, never a path, so it may be any text without separators or control codes."""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_LABEL_FORBIDDEN = re.compile(r"[/\\\x00-\x1f\x7f]")
PLAIN_NAME = "letters, digits, '_', '-' and '.', starting with a letter or digit"
CLASS_NAME = "no separators, control codes or surrounding blanks"


def is_plain_name(name) -> bool:
    """A dataset or domain name: one file-name component, no separator, no '..', nothing hidden."""
    return isinstance(name, str) and bool(_NAME.fullmatch(name))


def is_class_name(name) -> bool:
    """Any text (spaces too) but empty, '.', '..', surrounding blanks, separators and control codes."""
    return (isinstance(name, str) and name.strip() == name and name not in ("", ".", "..")
            and not _LABEL_FORBIDDEN.search(name))
