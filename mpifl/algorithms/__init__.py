"""Registry of federated algorithms, keyed by their ``--algo`` name.

Every module of this package is imported here; each :class:`~mpifl.algorithms.core.base.Algorithm` subclass
with a ``name`` registers itself, so a new method is one new file.
"""

import importlib
import pkgutil

from ..errors import MpiflError
from ..transport.share import SharePolicy
from .core.base import REGISTRY, Algorithm
from .core.reduction import Folding, Reduction, weighted_mean
from .core.state import ClientState, ServerState, Uploads

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

ALGORITHMS: dict[str, type[Algorithm]] = dict(sorted(REGISTRY.items()))


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise MpiflError(f"unknown algorithm '{name}'; choose one of: {', '.join(ALGORITHMS)}") from None


def all_options() -> dict:
    """Every method-specific option, by name (same-named options must agree on type)."""
    merged = {}
    for cls in ALGORITHMS.values():
        for opt in cls.options:
            if opt.name in merged and merged[opt.name].type is not opt.type:
                raise TypeError(f"option {opt.name} declared with two types")
            merged.setdefault(opt.name, opt)
    return merged


__all__ = ["ALGORITHMS", "Algorithm", "ClientState", "Folding", "Reduction", "ServerState", "SharePolicy", "Uploads",
           "all_options", "get_algorithm", "weighted_mean"]
