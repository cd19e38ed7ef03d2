"""README's six steps of "Add a method", followed as written on a copy of the repository: a new method (FedProx
with a server learning rate) is one file, one README row, its tests, a note and the regenerated options page,
and the quick loop's tests then pass and train it for a round.  The same file declaring ``--server-lr`` anew,
as the old step 2 showed, stops the methods from loading."""

import os
import shutil
import subprocess
import sys

from ..conftest import REPO

NAME, MODULE = "fedprox-slr", "fedprox_slr"

METHOD = '''\
"""FedProx with a server learning rate: FedProx's clients, the server step x <- x + eta (mean - x)."""

from .core.options import SERVER_LR
from .core.server_opt import ServerOptimizer
from .fedprox import FedProx


class FedProxSLR(ServerOptimizer, FedProx):
    name = "fedprox-slr"
    summary = "FedProx with a server learning rate"
    options = FedProx.options + (SERVER_LR,)
    defaults = {"server_lr": 0.5}
'''

TEST = '''\
from .helpers import make_algo


def test_its_server_step_is_half_way_by_default():
    algo, _ = make_algo("fedprox-slr")
    assert algo.cfg.opt("server_lr") == 0.5 and algo.cfg.opt("mu") == 0.01
'''

#: a step 2 gone wrong: the shared --server-lr declared again, with a help of its own
REDECLARED = METHOD.replace("from .core.options import SERVER_LR\n", "from ..plan.config import Option\n").replace(
    "(SERVER_LR,)", '(Option("server_lr", float, 0.5, "server step size"),)')

QUICK_LOOP = [f"tests/algorithms/test_registry.py::test_every_registered_method_trains_one_round[{NAME}]",
              "tests/algorithms/test_registry.py::"
              "test_readme_table_has_one_row_per_registered_algorithm_and_no_stale_row",
              f"tests/algorithms/test_{MODULE}.py", "tests/job/test_options_doc.py"]


def _run(copy, command: str) -> subprocess.CompletedProcess:
    """``command`` in a shell, in the copy, which is the only mpifl it imports."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    return subprocess.run(command, shell=True, cwd=copy, env=env, capture_output=True, text=True, timeout=300)


def _steps(copy) -> None:
    """Steps 1 (the file; step 2 is its content), 3, 4 and 6 as README writes them; 5 is nothing to do."""
    (copy / "mpifl" / "algorithms" / f"{MODULE}.py").write_text(METHOD)
    readme = copy / "README.md"
    text = readme.read_text()
    at = text.index("\n", text.index("| `fedprox` |"))
    readme.write_text(text[:at] + f"\n| `{NAME}` | as FedProx; server step x ← x + η Δ (`--server-lr`) | as FedAvg "
                                   "| global model |" + text[at:])
    (copy / "tests" / "algorithms" / f"test_{MODULE}.py").write_text(TEST)
    methods = copy / "docs" / "methods.md"
    methods.write_text(methods.read_text() + f"\n- **FedProx-SLR** (`{NAME}`): FedProx with a server step.\n")


def test_the_six_steps_give_a_method_the_quick_loop_trains(tmp_path):
    copy = tmp_path / "repo"
    for part in ("mpifl", "tests", "docs"):
        shutil.copytree(REPO / part, copy / part)
    for part in ("README.md", "setup.cfg", "pyproject.toml"):
        shutil.copy2(REPO / part, copy / part)
    python, page = sys.executable, copy / "docs" / "options.md"

    (copy / "mpifl" / "algorithms" / f"{MODULE}.py").write_text(REDECLARED)
    loading = _run(copy, f"{python} -c 'import mpifl.algorithms'")
    assert loading.returncode != 0, "a method declaring --server-lr anew loaded"
    assert (f"option --server-lr is declared twice, differently, by fedavg-slr (" in loading.stderr
            and f"and by {NAME} (" in loading.stderr), loading.stderr[-2000:]

    _steps(copy)
    before = page.read_text()
    regenerate = _run(copy, f"{python} -m mpifl.job.options_doc > docs/options.md")  # step 6's command
    assert regenerate.returncode == 0, regenerate.stderr[-2000:]
    assert page.read_text() != before and NAME in page.read_text()
    quick = _run(copy, f"{python} -m pytest -v -p no:cacheprovider -m 'not slow' {' '.join(QUICK_LOOP)}")
    assert quick.returncode == 0, quick.stdout[-3000:]
    assert f"test_every_registered_method_trains_one_round[{NAME}] PASSED" in quick.stdout, quick.stdout[-3000:]
    assert f"test_{MODULE}.py::test_its_server_step_is_half_way_by_default PASSED" in quick.stdout
