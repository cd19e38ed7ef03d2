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


_NUMBERED = re.compile(r"\d+\.(?=\D)")  # Caltech-256's class folders: '003.backpack'
_SEPARATORS = re.compile(r"[\s_-]+")
#: How :func:`folder_key` matches, for messages.
MATCHING = "in any case, with or without '-', '_' or blanks between words"


def folder_key(name: str) -> str:
    """What a folder or file name is matched by: case, the separators ``-``, ``_`` and blanks, and a leading
    Caltech-256 number (``003.``) do not count, so ``Back-Pack``, ``back_pack`` and ``003.backpack`` match."""
    name = name.strip()
    numbered = _NUMBERED.match(name)
    return _SEPARATORS.sub("", name[numbered.end():] if numbered else name).casefold()


class Aliases:
    """Canonical names, each with the other names it is found under, all matched by :func:`folder_key`.

    ``names`` maps a canonical name to its other names (``{"laptop_computer": ("laptop",)}``).  Two
    canonical names that one name would match are a programming error (``ValueError``).
    """

    def __init__(self, names: dict[str, tuple[str, ...]]):
        self.names = dict(names)
        self._table: dict[str, str] = {}
        for canonical, others in self.names.items():
            for name in (canonical, *others):
                first = self._table.setdefault(folder_key(name), canonical)
                if first != canonical:
                    raise ValueError(f"{name!r} would match both {first!r} and {canonical!r}")

    def resolve(self, name: str) -> str | None:
        """The canonical name ``name`` stands for, or None."""
        return self._table.get(folder_key(name))

    def accepted(self) -> str:
        """The canonical names and their aliases (those not already matched by the canonical spelling)."""
        shown = []
        for canonical, others in self.names.items():
            keys = {folder_key(canonical)}
            extra = [o for o in others if folder_key(o) not in keys and not keys.add(folder_key(o))]
            shown.append(canonical + (f" (or {', '.join(extra)})" if extra else ""))
        return ", ".join(shown)
