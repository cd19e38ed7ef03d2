"""Seeded stratified splits shared by the converters: deterministic, disjoint and covering."""

from __future__ import annotations

import zlib

import numpy as np

#: Base seed of every seeded split (train/val/test cut and val carved from train).
SPLIT_SEED = 20_240_601


def _rng(*key: str | int) -> np.random.Generator:
    """A generator seeded from SPLIT_SEED and ``key`` (strings hashed with CRC-32)."""
    words = [SPLIT_SEED] + [zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in key]
    return np.random.default_rng(words)


def _cuts(n: int, fractions) -> list[int]:
    """Cut points of ``n`` items at the cumulative ``fractions`` (rounded half up)."""
    bounds, total = [0], 0.0
    for f in fractions[:-1]:
        total += f
        bounds.append(min(n, int(np.floor(n * total + 0.5))))
    bounds.append(n)
    return bounds


def stratified_split(groups: dict, fractions, key: tuple = ()) -> list[list]:
    """Split every group (class -> list of items) by ``fractions``; return one item list per fraction.

    Each group is permuted by a generator seeded from ``(SPLIT_SEED, *key,
    group name)`` and cut at the cumulative fractions, rounded half up; the
    parts keep the groups in sorted order and, within a group, the items'
    given order.  Deterministic, disjoint and covering.
    """
    parts = [[] for _ in fractions]
    for name in sorted(groups):
        items = list(groups[name])
        order = _rng(*key, str(name)).permutation(len(items))
        bounds = _cuts(len(items), fractions)
        for k in range(len(fractions)):
            chosen = np.sort(order[bounds[k]:bounds[k + 1]])
            parts[k].extend(items[i] for i in chosen)
    return parts


def split_rows(rows: list, classes, fractions, key: tuple) -> list[list]:
    """A seeded stratified split of ``(path, label)`` rows by ``fractions``; one row list per fraction.

    Rows are grouped by class name (``classes[label]``) and split with
    :func:`stratified_split` under ``key``; every part keeps the rows' given order.
    """
    by_class: dict = {}
    for i, (_, label) in enumerate(rows):
        by_class.setdefault(classes[label], []).append(i)
    return [[rows[i] for i in sorted(part)] for part in stratified_split(by_class, fractions, key)]
