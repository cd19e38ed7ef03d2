"""Registry of federated algorithms, keyed by their ``--algo`` name.

Every module of this package is imported here; each :class:`~mpifl.algorithms.core.base.Algorithm` subclass
with a ``name`` registers itself, so a new method is one new file.  An option several methods take is declared
once (:mod:`.core.options`): loading refuses two different declarations of one name.
"""

import importlib
import pkgutil

from ..errors import MpiflError
from ..plan.config import Option
from ..transport.share import SharePolicy
from .core.base import REGISTRY, Algorithm
from .core.options import declarations
from .core.reduction import Reduction, weighted_mean
from .core.state import ClientState, ServerState, Uploads

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

ALGORITHMS: dict[str, type[Algorithm]] = dict(sorted(REGISTRY.items()))


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise MpiflError(f"unknown algorithm '{name}'; choose one of: {', '.join(ALGORITHMS)}") from None


def all_options() -> dict[str, Option]:
    """Every method-specific option, by name: its one declaration (:func:`~.core.options.declarations`)."""
    return declarations(ALGORITHMS)


all_options()  # two methods declaring one option differently stop the methods from loading


__all__ = ["ALGORITHMS", "Algorithm", "ClientState", "Reduction", "ServerState", "SharePolicy", "Uploads",
           "all_options", "get_algorithm", "weighted_mean"]
