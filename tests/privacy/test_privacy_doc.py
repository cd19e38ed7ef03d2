"""docs/privacy.md's methods table, and the README's privacy column, are what the methods' manifests and the
mechanisms' refusals say."""

import re

from mpifl.job.privacy_doc import BEGIN, END, PAGE, methods_table, page_with_table

README = PAGE.parents[1] / "README.md"
SHORT = ("DP", "SA", "DP-SGD")  # the README's names of the table's mechanisms, in its columns' order


def test_the_privacy_table_and_the_readme_column_are_what_the_code_generates(data_root):
    table = methods_table(str(data_root))
    page = PAGE.read_text()
    assert BEGIN in page and END in page
    assert page == page_with_table(page, table), \
        "docs/privacy.md's table is out of date; regenerate it: python -m mpifl.job.privacy_doc --data-root DIR"
    supported = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        supported[cells[0]] = ", ".join(n for n, c in zip(SHORT, cells[2:]) if c == "yes") or "none"
    readme = {}
    for line in README.read_text().splitlines():
        if line.startswith("| `") and line.count("|") == 6 and not line.startswith("| `--algo`"):
            for name in re.findall(r"`([a-z0-9-]+)`", line.split("|")[1]):
                readme[name] = line.rstrip(" |").rsplit("|", 1)[1].strip()
    assert readme == supported
