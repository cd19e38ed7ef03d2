"""The registry fills itself from the method files, README's algorithm table matches it, and the quick loop
trains every method it holds for a round."""

import math
import re

import pytest

from mpifl.algorithms import ALGORITHMS, get_algorithm
from mpifl.algorithms.core.base import Algorithm
from mpifl.errors import MpiflError

from ..conftest import REPO, read_metrics, run_here
from .helpers import own_options


def _readme_algorithms() -> list[str]:
    """Every `--algo` name in the first column of README's table under '## Algorithms'."""
    section = REPO.joinpath("README.md").read_text().split("\n## Algorithms\n", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| `") and not line.startswith("| `--"):  # rows, not the header
            names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def test_readme_table_has_one_row_per_registered_algorithm_and_no_stale_row():
    names = _readme_algorithms()
    assert len(names) == len(set(names)), "an algorithm appears twice in README's table"
    assert set(names) == set(ALGORITHMS), (sorted(set(ALGORITHMS) - set(names)), sorted(set(names) - set(ALGORITHMS)))


def test_a_subclass_with_a_name_registers_itself_and_a_second_of_that_name_is_refused():
    from mpifl.algorithms.core.base import REGISTRY

    class Probe(Algorithm):
        name = "probe-registration"

    try:
        assert REGISTRY["probe-registration"] is Probe
        with pytest.raises(TypeError, match="two algorithms named 'probe-registration'"):
            type("Again", (Algorithm,), {"name": "probe-registration"})

        class Unnamed(Probe):  # inherits the name: not a method of its own
            pass

        assert REGISTRY["probe-registration"] is Probe
    finally:
        REGISTRY.pop("probe-registration")


def test_unknown_algorithm_is_one_line_naming_the_choices():
    with pytest.raises(MpiflError, match=r"^unknown algorithm 'nope'; choose one of: [a-z, -]*\bfedavg, [a-z, -]*$"):
        get_algorithm("nope")


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_every_registered_method_trains_one_round(data_root, style_model, tmp_path, algo):
    """A new method runs in the quick loop (``-m 'not slow'``) as soon as its file exists: one round in this
    process, 5 clients of 8 images, one thread (tests/job/test_run.py's slow runs check bytes and learning)."""
    job = run_here("--data-root", str(data_root), "--model", "smallcnn", "--out", str(tmp_path / "run"), "--algo",
                   algo, "--rounds", "1", "--threads", "1", *own_options(algo, style_model),
                   "--samples-per-client", "8", "--batch-size", "4")  # the last of a flag given twice counts
    assert job.returncode == 0, job.stderr
    [record] = read_metrics(tmp_path / "run")
    assert record["round"] == 1 and math.isfinite(record["train"]["loss"]), record
