"""docs/privacy.md's methods table is what the methods' manifests and the mechanisms' refusals say."""

from mpifl.job.privacy_doc import BEGIN, END, PAGE, methods_table, page_with_table


def test_docs_privacy_md_table_is_what_the_code_generates(data_root):
    page = PAGE.read_text()
    assert BEGIN in page and END in page
    assert page == page_with_table(page, methods_table(str(data_root))), \
        "docs/privacy.md's table is out of date; regenerate it: python -m mpifl.job.privacy_doc --data-root DIR"
