"""A converter's source file behind a symbolic link that leads nowhere (dangling, or looping) is refused by name:
skipped, it would change the dataset without a word."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from mpifl.errors import MpiflError


def check_link(path: Path, what: str) -> None:
    """One line if ``path`` (a ``what``: image, volume) is a symbolic link to nothing that can be read."""
    if not path.is_symlink():
        return
    try:
        os.stat(path)
    except OSError as exc:
        problem = "loops" if exc.errno == errno.ELOOP else f"leads to {os.readlink(path)}, which does not exist"
        raise MpiflError(f"{what} {path} is a symbolic link that {problem}; restore what it points to, or remove "
                         "it") from None
