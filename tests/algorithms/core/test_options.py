"""An option several methods take is declared once (mpifl.algorithms.core.options); a method's own default of it
is its ``defaults``; a second, different declaration of a name is refused when the methods load."""

from dataclasses import replace

import pytest

from mpifl.algorithms import ALGORITHMS, all_options
from mpifl.algorithms.core import options as shared
from mpifl.algorithms.core.base import REGISTRY
from mpifl.algorithms.core.options import MU, SERVER_LR, declarations
from mpifl.algorithms.fedavg import FedAvg
from mpifl.algorithms.fedprox import FedProx
from mpifl.errors import MpiflError
from mpifl.job.cli import command, configuration
from mpifl.plan.config import Option

SHARED = {o.name: o for o in vars(shared).values() if isinstance(o, Option)}


def _method(name, options=(), defaults=None, base=FedAvg):
    """A method class that is not registered (it inherits its base's ``name``)."""
    return type(name, (base,), {"options": base.options + tuple(options), "defaults": defaults or base.defaults})


def test_every_option_two_methods_take_is_the_one_shared_declaration():
    taken = {}
    for cls in ALGORITHMS.values():
        for option in cls.options:
            taken.setdefault(option.name, []).append(cls)
    several = {name for name, classes in taken.items() if len(classes) > 1}
    assert several and several <= set(SHARED), sorted(several - set(SHARED))
    assert {name: all_options()[name] for name in several} == {name: SHARED[name] for name in several}


def test_each_methods_default_of_a_shared_option_is_the_one_it_has_always_had():
    defaults = {(name, o.name): o.default for name, cls in ALGORITHMS.items() for o in cls.options if o.name in SHARED}
    own = {key: value for key, value in defaults.items() if value != SHARED[key[1]].default}
    assert own == {("fedadagrad", "server_lr"): 0.1, ("fedadagrad", "beta1"): 0.0, ("fedadam", "server_lr"): 0.01,
                   ("fedyogi", "server_lr"): 0.01, ("fedproto", "mu"): 1.0, ("gperxan", "guide_lambda"): 0.5,
                   ("fedasync", "mu"): 0.005}
    assert all(key[0] in ALGORITHMS and key[1] in ALGORITHMS[key[0]].defaults for key in own)


def test_a_second_declaration_with_another_default_help_or_type_is_refused_naming_both_methods():
    for other in (replace(MU, default=0.5), replace(MU, help="my weight"), replace(MU, type=int, default=0, minimum=0)):
        methods = {"fedprox": FedProx, "newmethod": _method("NewMethod", [other])}
        with pytest.raises(TypeError, match=r"option --mu is declared twice, differently, by fedprox \(.*\) and by "
                                            r"newmethod \(.*\); declare it once \(mpifl/algorithms/core/options.py"):
            declarations(methods)


def test_a_methods_own_default_goes_in_its_defaults_and_nowhere_else():
    own = _method("Own", [SERVER_LR], {"server_lr": 0.5})
    assert {o.name: o.default for o in own.options}["server_lr"] == 0.5
    assert declarations({"fedavg-slr": ALGORITHMS["fedavg-slr"], "own": own})["server_lr"] == SERVER_LR
    stray = _method("Stray", [replace(SERVER_LR, help="my step")], {"server_lr": 0.5})
    with pytest.raises(TypeError, match="declared twice, differently, by fedavg-slr"):
        declarations({"fedavg-slr": ALGORITHMS["fedavg-slr"], "stray": stray})
    with pytest.raises(TypeError, match=r"^Unknown: defaults names server_lr, which are not among its options"):
        _method("Unknown", defaults={"server_lr": 0.5})


def test_guide_lambda_is_the_one_every_method_takes_and_a_default_of_its_own_goes_in_defaults():
    guided = _method("Guided", defaults={"guide_lambda": 0.25})
    assert guided.options[-1] == replace(shared.GUIDE_LAMBDA, default=0.25)
    with pytest.raises(TypeError, match="^Redeclared: its --guide-lambda .* is not the one every method takes"):
        _method("Redeclared", [replace(shared.GUIDE_LAMBDA, default=0.25)])


def test_the_registry_refuses_a_registered_method_that_redeclares_an_option():
    """What loading the methods runs (``all_options``), over the registry with one more method in it."""
    clash = type("Clash", (FedAvg,), {"name": "probe-clash", "options": FedAvg.options + (replace(MU, default=2.0),)})
    try:
        ALGORITHMS["probe-clash"] = clash
        with pytest.raises(TypeError, match="by fednn .* and by probe-clash"):
            all_options()
    finally:
        ALGORITHMS.pop("probe-clash")
        REGISTRY.pop("probe-clash")


def test_help_names_each_methods_own_default_of_a_shared_option():
    helps = {p.opts[0]: p.help for p in command().params}
    assert helps["--server-lr"].endswith("[default fedadagrad 0.1, fedadam 0.01, fedavg-slr 1.0, fedavgm 1.0, "
                                         "fedbuff 1.0, fedyogi 0.01, scaffold 1.0]")
    assert helps["--mu"].startswith(MU.help) and helps["--mu"].endswith("fedproto 1.0, fedprox 0.01]")
    assert "fedasync 0.005" in helps["--mu"]
    assert helps["--guide-lambda"].endswith("[every method; default 0.0, gperxan 0.5]")


COUNTS = sorted({(name, o.name, o.minimum) for name, cls in ALGORITHMS.items() for o in cls.options if o.type is int})


def _parsed(*argv):
    """The configuration the command line makes of ``argv``, as every rank builds it."""
    return configuration(argv)[0]


def test_every_count_a_method_takes_declares_its_least_value_and_one_below_it_is_never_declared():
    assert COUNTS and all(minimum in (0, 1) for *_, minimum in COUNTS), COUNTS
    with pytest.raises(TypeError, match="--brand-new counts something .*declare its least value"):
        Option("brand_new", int, 3, "a count with no least value")


@pytest.mark.parametrize("method,name,minimum", COUNTS)
def test_every_count_below_its_least_value_is_refused_on_the_command_line_in_one_line(method, name, minimum):
    flag = "--" + name.replace("_", "-")
    assert _parsed("--algo", method, flag, str(minimum)).opt(name) == minimum
    with pytest.raises(MpiflError, match=f"^{flag} must be >= {minimum}, got {minimum - 5}$"):
        _parsed("--algo", method, flag, str(minimum - 5))
