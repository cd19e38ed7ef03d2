"""A source file behind a symbolic link that leads nowhere is refused by name, at any shape of link."""

import pytest

from mpifl.data.links import check_link
from mpifl.errors import MpiflError


def test_dangling_and_looping_links_are_refused_and_others_pass(tmp_path):
    (tmp_path / "real.jpg").write_bytes(b"x")
    (tmp_path / "good.jpg").symlink_to("real.jpg")
    (tmp_path / "gone.jpg").symlink_to("missing/real.jpg")
    (tmp_path / "self.jpg").symlink_to("self.jpg")
    (tmp_path / "a.jpg").symlink_to("b.jpg")
    (tmp_path / "b.jpg").symlink_to("a.jpg")
    for ok in ("real.jpg", "good.jpg", "absent.jpg"):
        check_link(tmp_path / ok, "image")
    with pytest.raises(MpiflError, match=f"^image {tmp_path / 'gone.jpg'} is a symbolic link that leads to "
                                         "missing/real.jpg, which does not exist; restore what it points to"):
        check_link(tmp_path / "gone.jpg", "image")
    for loop in ("self.jpg", "a.jpg"):
        with pytest.raises(MpiflError, match=f"^image {tmp_path / loop} is a symbolic link that loops;"):
            check_link(tmp_path / loop, "image")
