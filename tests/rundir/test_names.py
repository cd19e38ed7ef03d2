"""The run directory's files have one owner: their names are typed only in ``mpifl/rundir/names.py`` (every other
module, launch script and batch script takes them from there), and only ``mpifl/rundir`` writes them.

Both are read off the sources.  A name typed by hand is a run file's name as a whole path component in a Python
string without spaces (a path, not prose: a help text or a message may name a file) or on a shell line that is not
a comment.  A write by hand is a
call that writes, removes or renames (``open`` for writing, ``write_text``, ``unlink``, ``os.replace``, ...) on
a path built from a name imported from ``mpifl.rundir.names``, directly or through a variable or attribute
assigned from one in the same file; a path handed through a function's arguments is not followed."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from mpifl.rundir import names

from ..conftest import REPO

#: The files a run writes, and the constants in mpifl/rundir/names.py that name them.
FILES = {names.CONFIG: "CONFIG", names.METRICS: "METRICS", names.LOG: "LOG", names.SUMMARY_CSV: "SUMMARY_CSV",
         names.SUMMARY_MD: "SUMMARY_MD", names.CHECKPOINT_META: "CHECKPOINT_META",
         names.TRACEBACKS.split("*")[0]: "TRACEBACKS"}
PATH = re.compile(r"(^|/)(" + "|".join(re.escape(n) for n in FILES) + r")")  # in a Python string: a path
WORD = re.compile(r"(^|[/\s\"'=])(" + "|".join(re.escape(n) for n in FILES) + r")")  # on a shell line
#: slurm/common.sh runs on the batch host, perhaps without mpifl's Python (MPIFL_PROGRAM may be a container's):
#: it declares the two names it looks for once, and test_the_batch_scripts_names_are_rundirs checks them.
SHELL_DECLARED = {"_mpifl_checkpoint_meta": f"{names.CHECKPOINT}/{names.CHECKPOINT_META}",
                  "_mpifl_summary": names.SUMMARY_MD}
WRITES = {"write_text", "write_bytes", "touch", "mkdir", "unlink", "rmdir", "rename", "replace", "symlink_to"}
MOVES = {"os.replace", "os.rename", "os.remove", "os.unlink", "shutil.move", "shutil.copy", "shutil.copyfile",
         "shutil.copy2", "shutil.rmtree"}


def python_sources(root: Path) -> list[Path]:
    """The Python files outside mpifl/rundir: the package's, and the launch scripts'."""
    package = [p for p in sorted((root / "mpifl").rglob("*.py")) if "rundir" not in p.relative_to(root).parts]
    return package + sorted((root / "launch").glob("*.py"))


def shell_sources(root: Path) -> list[Path]:
    return sorted((root / "launch").glob("*.sh")) + sorted((root / "slurm").glob("*.sh"))


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def typed_names(root: Path) -> list[str]:
    """``file:line: text`` of every run file name typed by hand outside mpifl/rundir."""
    found = []
    for path in python_sources(root):
        tree = ast.parse(path.read_text(), str(path))
        docstrings = _docstrings(tree)
        for node in sorted((n for n in ast.walk(tree) if hasattr(n, "lineno")), key=lambda n: n.lineno):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and not any(c.isspace() for c in node.value) and PATH.search(node.value)):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    for path in shell_sources(root):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#")[0] if not line.lstrip().startswith("#") else ""
            declared = code.split("=")[0].strip() in SHELL_DECLARED
            if WORD.search(code) and not declared:
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def _imported_names(tree: ast.AST) -> set[str]:
    """The local names a module binds to run file names of mpifl.rundir.names."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("rundir.names"):
            bound |= {alias.asname or alias.name for alias in node.names
                      if alias.name in set(FILES.values()) | {"traceback_file", "CHECKPOINT", "ATTEMPTS"}}
    return bound


def _mentions(node: ast.AST, tainted: set[str]) -> bool:
    return any(isinstance(n, (ast.Name, ast.Attribute)) and ast.unparse(n) in tainted for n in ast.walk(node))


def _mode(call: ast.Call, position: int) -> str:
    given = call.args[position] if len(call.args) > position else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    return given.value if isinstance(given, ast.Constant) and isinstance(given.value, str) else "r"


def writes_by_hand(root: Path) -> list[str]:
    """``file:line: call`` of every write into a run directory by a module outside mpifl/rundir."""
    found = []
    for path in python_sources(root):
        tree = ast.parse(path.read_text(), str(path))
        tainted = _imported_names(tree)
        if not tainted:
            continue
        grown = True
        while grown:  # variables and attributes assigned from a run file's path
            before = len(tainted)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    if _mentions(node.value, tainted):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        tainted |= {ast.unparse(t) for t in targets}
                elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                    if _mentions(node.context_expr, tainted):
                        tainted.add(ast.unparse(node.optional_vars))
            grown = len(tainted) > before
        for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno):
            func = node.func
            name = ast.unparse(func)
            writes = False
            if isinstance(func, ast.Attribute) and _mentions(func.value, tainted):
                writes = func.attr in WRITES or (func.attr == "open" and set(_mode(node, 0)) & set("wax+"))
            elif name == "open" and node.args and _mentions(node.args[0], tainted):
                writes = bool(set(_mode(node, 1)) & set("wax+"))
            elif name in MOVES:
                writes = any(_mentions(a, tainted) for a in node.args)
            if writes:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_run_file_name_is_typed_outside_rundir():
    assert typed_names(REPO) == []


def test_no_module_outside_rundir_writes_into_a_run_directory():
    assert writes_by_hand(REPO) == []


def test_the_batch_scripts_names_are_rundirs():
    text = (REPO / "slurm" / "common.sh").read_text()
    for variable, value in SHELL_DECLARED.items():
        assert re.findall(rf"^{variable}=(\S+)$", text, re.M) == [value]
        assert f"${variable}" in text or f"${{{variable}}}" in text


def test_the_checks_find_what_the_old_code_did_by_hand(tmp_path):
    """The checks fail on what they look for: the writes and names of the code before RunDir owned them."""
    (tmp_path / "mpifl" / "server").mkdir(parents=True)
    (tmp_path / "launch").mkdir()
    (tmp_path / "slurm").mkdir()
    (tmp_path / "mpifl" / "server" / "run_log.py").write_text('''"""Writes metrics.jsonl."""
from ..rundir.names import METRICS, SUMMARY_CSV, SUMMARY_MD, TMP


class MetricsLog:
    def __init__(self, run_dir):
        self.path = run_dir / METRICS
        self.run_dir = run_dir

    def resume(self, records):
        tmp = self.path.with_name(self.path.name + TMP)
        tmp.write_text("".join(records))
        tmp.replace(self.path)

    def write(self, line):
        print(self.path.read_text())
        with self.path.open("a") as f:
            f.write(line)

    def summary(self, text):
        with (self.run_dir / SUMMARY_CSV).open("w", newline="") as f:
            f.write(text)
        (self.run_dir / SUMMARY_MD).write_text(text)
''')
    (tmp_path / "mpifl" / "server" / "serve.py").write_text('''from ..rundir.names import LOG


def serve(run_dir, lines):
    with open(run_dir / LOG, "a") as log_file:
        log_file.write(lines)
    return (run_dir / 'checkpoint/meta.json').is_file()
''')
    (tmp_path / "launch" / "sweep.py").write_text('summary = out / "runs" / name / "summary.csv"\n')
    (tmp_path / "launch" / "bench.sh").write_text('# metrics.jsonl in a comment is prose\n'
                                                  'records = (run / "metrics.jsonl").read_text()\n')
    (tmp_path / "slurm" / "common.sh").write_text('if [[ -f $RUN_DIR/checkpoint/meta.json ]]; then\n'
                                                  '_mpifl_summary=summary.md\n')
    assert [line.split(": ")[0] for line in writes_by_hand(tmp_path)] == [
        "mpifl/server/run_log.py:12", "mpifl/server/run_log.py:13", "mpifl/server/run_log.py:17",
        "mpifl/server/run_log.py:21", "mpifl/server/run_log.py:23", "mpifl/server/serve.py:5"]
    assert [line.split(": ")[0] for line in typed_names(tmp_path)] == [
        "mpifl/server/serve.py:7", "launch/sweep.py:1", "launch/bench.sh:2", "slurm/common.sh:1"]


def test_the_names_import_without_the_packages_of_a_run():
    """Any Python can ask for a name (launch/sweep.py runs with whatever Python starts it): no torch, numpy."""
    probe = ("import sys, mpifl.rundir.names; "
             "print(*sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'h5py', 'mpi4py')))")
    job = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert job.stdout.strip() == ""
