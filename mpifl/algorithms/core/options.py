"""The options that several methods take, each declared here once, and the rule that keeps them declared once.

A method lists its options in ``options``: the ones below, imported, and its own.  A name is one flag with one
type, one help text and one default; a method that needs another default names it in its ``defaults``
(FedAdam: ``defaults = {"server_lr": 1e-2}``), which :meth:`Algorithm.__init_subclass__
<mpifl.algorithms.core.base.Algorithm.__init_subclass__>` applies to its ``options`` (:func:`with_defaults`);
``--help`` and docs/options.md list each method's default.  When the methods load, :func:`declarations` refuses
two declarations of one name that differ in anything but a default set that way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from ...plan.config import Option

UNIFORM_WEIGHTS = Option("uniform_weights", bool, False, "weight clients equally in the average instead of by "
                         "sample count")
MU = Option("mu", float, 0.01, "weight mu of a method's extra local loss term: FedProx's (and FedNN's) proximal "
            "term mu/2 ||w - w_global||^2, FedProto's prototype loss (its lambda)", minimum=0)
CONCURRENCY = Option("concurrency", int, 0, "asynchronous aggregation: clients training at once (each free slot is "
                     "filled at once on the simulated clock, docs/clients.md); 0: --fraction's max(1, round(C N)) of "
                     "the N training clients", minimum=0)
STALENESS = Option("staleness", str, "polynomial", "asynchronous aggregation's staleness weight s(tau), tau the "
                   "server steps since the client's download: polynomial (tau + 1)^-a, hinge (1 for tau <= b, else "
                   "1 / (a (tau - b) + 1)) or constant 1 (Xie et al., 2019)",
                   choices=("polynomial", "hinge", "constant"))
STALENESS_A = Option("staleness_a", float, 0.5, "the a of --staleness (polynomial: 0.5 is FedBuff's 1/sqrt(1 + tau))",
                     minimum=0)
STALENESS_B = Option("staleness_b", int, 4, "the b of --staleness hinge: steps of staleness taken at full weight",
                     minimum=0)
SERVER_LR = Option("server_lr", float, 1.0,
                   "server (global) learning rate: x <- x + server_lr * (aggregated update)", minimum=0, above=True)
ALPHA = Option("alpha", float, 0.01,
               "regularization weight alpha (FedDyn: dynamic regularizer; FedDC: drift penalty)")
BETA1 = Option("beta1", float, 0.9, "server first-moment decay: m <- beta1 m + (1 - beta1) Delta", minimum=0,
               maximum=1, below=True)
BETA2 = Option("beta2", float, 0.99, "server second-moment decay: v <- beta2 v + (1 - beta2) Delta^2 (Yogi: "
               "v <- v - (1 - beta2) Delta^2 sign(v - Delta^2)); 0.99 is Flower's default, Reddi et al.'s "
               "experiments keep Keras' 0.999", minimum=0, maximum=1, below=True)
TAU = Option("tau", float, 1e-3, "server adaptivity: x <- x + server_lr m / (sqrt(v) + tau), v starting at tau^2",
             minimum=0, above=True)
GUIDE_LAMBDA = Option("guide_lambda", float, 0.0,
                      "weight lambda of the guiding regularizer lambda L(h_g(g(x)), y), L the task's loss (CE; on "
                      "segmentation the run's --seg-loss), h_g the downloaded classifier "
                      "frozen (gPerXAN, Le et al. 2024, eqs. 3-4); for any method whose download holds the "
                      "classifier, refused in one line by the others; 0 = off", minimum=0, zero="off")
DECLARATIONS_FILE = "mpifl/algorithms/core/options.py"


def with_defaults(method: str, options: tuple[Option, ...], defaults: Mapping[str, Any]) -> tuple[Option, ...]:
    """``options`` with the method's own ``defaults`` put in, in place; a default for an option the method does
    not take is refused."""
    stray = sorted(set(defaults) - {o.name for o in options})
    if stray:
        raise TypeError(f"{method}: defaults names {', '.join(stray)}, which are not among its options; add the "
                        f"option(s) to its options (the shared ones are in {DECLARATIONS_FILE}) or drop them from "
                        "defaults")
    return tuple(replace(o, default=defaults[o.name]) if o.name in defaults else o for o in options)


def agrees(option: Option, declared: Option, own_default: bool) -> bool:
    """Whether a method's ``option`` is the ``declared`` one: equal, but in the default when the method sets its
    own (``own_default``: the name is in its ``defaults``)."""
    return replace(option, default=declared.default) == declared if own_default else option == declared


def declarations(methods: Mapping[str, type]) -> dict[str, Option]:
    """Every option of ``methods`` (name -> class), by name: its one declaration.  Two methods declaring a name
    with another type, help or choices, or with another default that neither sets in its ``defaults``, are
    refused in one line naming both."""
    taken: dict[str, list[tuple[str, Option, bool]]] = {}
    for method, cls in methods.items():
        for option in cls.options:
            taken.setdefault(option.name, []).append((method, option, option.name in cls.defaults))
    return {name: _one_declaration(entries) for name, entries in taken.items()}


def _one_declaration(entries: list[tuple[str, Option, bool]]) -> Option:
    """The declaration the methods taking one option share: the first one taking its declared default."""
    method, first, _ = next((e for e in entries if not e[2]), entries[0])
    for other, option, own_default in entries:
        if not agrees(option, first, own_default):
            raise TypeError(f"option {option.flag} is declared twice, differently, by {method} ({first}) and by "
                            f"{other} ({option}); declare it once ({DECLARATIONS_FILE} holds the shared ones), "
                            "import that declaration, and give a method's own default in its `defaults`")
    return first
