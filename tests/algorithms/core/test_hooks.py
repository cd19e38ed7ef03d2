"""The hook table (:data:`mpifl.algorithms.core.hooks.HOOKS`) against Algorithm, the method files and the runtime."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections import Counter
from pathlib import Path

import pytest

import mpifl
from mpifl.algorithms import ALGORITHMS
from mpifl.algorithms.core.base import Algorithm
from mpifl.algorithms.core.helpers import AlgorithmHelpers
from mpifl.algorithms.core.hooks import BY_ROLE, HOOKS, Hook

PACKAGE = Path(mpifl.__file__).parent
BY_NAME = {hook.name: hook for hook in HOOKS}


def _function(attribute):
    """The function behind a class attribute (a method, classmethod, staticmethod or property), else None."""
    if isinstance(attribute, (classmethod, staticmethod)):
        return attribute.__func__
    if isinstance(attribute, property):
        return attribute.fget
    return attribute if inspect.isfunction(attribute) else None


def _public(cls: type) -> list[str]:
    """The public methods, classmethods and properties ``cls``'s own body defines, in its order."""
    return [name for name, value in vars(cls).items() if not name.startswith("_") and _function(value) is not None]


def _public_interface() -> list[str]:
    return _public(Algorithm) + _public(AlgorithmHelpers)


def sections(cls: type) -> dict[str, list[str]]:
    """The public methods of ``cls``'s body under each of its section comments (``# ---- role``, ``# ==== 1. role``,
    up to a colon or a parenthesis), by section, in order; those before the first section under ""."""
    found: dict[str, list[str]] = {"": []}
    section = ""
    for line in textwrap.dedent(inspect.getsource(cls)).splitlines():
        comment = re.match(r"    # [-=]+ (?:\d\. )?([^:(]+)", line)
        if comment:
            section = comment.group(1).strip()
            found[section] = []
        definition = re.match(r"    def (\w+)\(", line)
        if definition and not definition.group(1).startswith("_"):
            found[section].append(definition.group(1))
    return found


def _method_classes() -> list[type]:
    """Every class a registered method is built of (mixins included), but ``Algorithm`` and ``object``."""
    seen = {}
    for cls in ALGORITHMS.values():
        for base in cls.__mro__:
            if base not in (Algorithm, AlgorithmHelpers, object):
                seen.setdefault(base, None)
    return list(seen)


def calls_super(cls: type, name: str) -> bool:
    """Whether ``cls``'s own ``name`` calls ``super().name`` (anywhere in its body, under a condition too)."""
    source = textwrap.dedent(inspect.getsource(_function(vars(cls)[name])))
    return any(isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Call)
               and isinstance(node.value.func, ast.Name) and node.value.func.id == "super"
               for node in ast.walk(ast.parse(source)))


def unchained(classes, hooks=None) -> set[tuple[str, str]]:
    """(class, hook) of every override of a ``chain`` hook (of ``hooks``, default HOOKS) that does not call
    ``super()``'s."""
    return {(cls.__name__, hook.name) for cls in classes for hook in (HOOKS if hooks is None else hooks)
            if hook.chain and hook.name in vars(cls) and not calls_super(cls, hook.name)}


def _attributes(package: str) -> set[str]:
    """Every attribute name accessed (``x.name``) in the modules of ``mpifl/<package>``."""
    names = set()
    for path in sorted((PACKAGE / package).rglob("*.py")):
        names |= {node.attr for node in ast.walk(ast.parse(path.read_text(), str(path)))
                  if isinstance(node, ast.Attribute)}
    return names


def test_the_table_names_every_public_method_of_algorithm_once_and_nothing_else():
    names = [hook.name for hook in HOOKS]
    twice = [name for name, count in Counter(names).items() if count > 1]
    assert not twice, f"in HOOKS more than once: {twice}"
    interface = _public_interface()
    assert set(interface) - set(names) == set(), "public on Algorithm, missing from HOOKS"
    assert set(names) - set(interface) == set(), "in HOOKS, not a method of Algorithm"
    assert all(hook.when for hook in HOOKS)


def sections_unlike_the_table(cls: type, kind: str, by_role=None) -> list[str]:
    """How ``cls``'s body differs from the ``kind`` entries ("hook" or "helper") of ``by_role`` (default
    :data:`BY_ROLE`): a section per role that has any, in the table's order, each with its names in order."""
    table = {role: [h.name for h in hooks if h.kind == kind] for role, hooks in (by_role or BY_ROLE).items()}
    want = {role: names for role, names in table.items() if names}
    body = sections(cls)
    before = body.pop("")
    wrong = [f"before the first section: {before}"] if before else []
    if list(body) != list(want):
        wrong.append(f"sections {list(body)}, table's roles {list(want)}")
    return wrong + [f"{role}: {body[role]}, table: {names}" for role, names in want.items()
                    if role in body and body[role] != names]


def test_algorithms_body_shows_its_hooks_by_role_and_the_helpers_are_apart():
    assert sections_unlike_the_table(Algorithm, "hook") == [], "Algorithm's body: a section per role of BY_ROLE"
    assert sections_unlike_the_table(AlgorithmHelpers, "helper") == [], "AlgorithmHelpers' body, by role"


def behind(classes, by_role=None) -> dict[str, tuple[str, str]]:
    """(first, most overridden) hook of each role of ``by_role`` (default :data:`BY_ROLE`) whose first hook
    ``classes`` override less often than another of its hooks."""
    count = Counter(hook.name for cls in classes for hook in HOOKS if hook.name in vars(cls))
    found = {}
    for role, hooks in (by_role or BY_ROLE).items():
        most = max((h for h in hooks if h.kind == "hook"), key=lambda h: count[h.name])
        if count[hooks[0].name] < count[most.name]:
            found[role] = (hooks[0].name, most.name)
    return found


def test_each_role_starts_with_the_hook_most_methods_override():
    assert behind(_method_classes()) == {}, "(first, most overridden) by role: move the most overridden first " \
        "(BY_ROLE, base.py)"


def test_the_role_checks_catch_a_helper_among_the_hooks_and_a_rare_hook_first():
    class Mixed(Algorithm):
        # ---------------------------------------------------------------- client training
        def end_local(self, client, model):
            return {}

        def begin_local(self, client, model, download):
            super().begin_local(client, model, download)

        def plus_extra(self, loss, *args):
            return loss

    class Rare(Algorithm):
        def end_local(self, client, model):
            return {}

    table = {"client training": (Hook("begin_local", "client", "t"), Hook("end_local", "client", "t"),
                                 Hook("plus_extra", "internal", "t", kind="helper"))}
    assert sections_unlike_the_table(Mixed, "hook", table) == [
        "client training: ['end_local', 'begin_local', 'plus_extra'], table: ['begin_local', 'end_local']"]
    assert behind([Rare, Mixed], table) == {"client training": ("begin_local", "end_local")}
    assert behind([Mixed], table) == {}


def test_every_override_of_a_chained_hook_calls_super():
    assert {h.name for h in HOOKS if h.chain} >= {"begin_local", "extra_loss"}  # base.py's docstrings say so
    assert unchained(_method_classes()) == set(), "overrides without super(); see HOOKS' chain"


def test_no_method_overrides_a_helper():
    overridden = {(cls.__name__, hook.name) for cls in _method_classes() for hook in HOOKS
                  if hook.kind == "helper" and hook.name in vars(cls)}
    assert overridden == set(), "a helper a method overrides is a hook: say so in HOOKS"


def test_each_hook_is_called_from_the_runtime_package_its_where_names_and_an_internal_one_from_none():
    runtime = {package: _attributes(package) for package in ("server", "client", "session", "transport")}
    called = {name: {package for package, names in runtime.items() if name in names} for name in BY_NAME}
    wrong = []
    for hook in HOOKS:
        at = called[hook.name]
        if hook.where == "every rank":
            ok = bool(at & {"session", "transport"}) or {"server", "client"} <= at
        elif hook.where == "internal":
            ok = not at
        else:
            ok = hook.where in at
        if not ok:
            wrong.append(f"{hook.name}: where {hook.where!r}, called in mpifl/{{{', '.join(sorted(at))}}}")
    assert not wrong, wrong


def test_the_super_check_catches_an_override_that_forgets_super():
    class Forgets(Algorithm):
        def begin_local(self, client, model, download):
            self.held = download

        def init_server(self, initial):
            return super().download(initial)  # super(), of another hook

    class Chains(Algorithm):
        def begin_local(self, client, model, download):
            if download:
                super().begin_local(client, model, download)

        @property
        def adopted_keys(self):  # not chained: free to replace
            return []

    assert not calls_super(Forgets, "begin_local") and calls_super(Chains, "begin_local")
    assert unchained([Forgets, Chains]) == {("Forgets", "begin_local"), ("Forgets", "init_server")}
    assert unchained([Forgets], [Hook("begin_local", "client", "t", chain=False)]) == set()


def test_a_hook_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="where 'rank 0'"):
        Hook("download", "rank 0", "every message")
