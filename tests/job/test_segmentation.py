"""Segmentation runs end to end on the generated ``styleshapes`` (U-Net, Dice): FedRDN's Table 2 methods with
``--aug fedrdn``, and a method whose rule needs classes refused in one line."""

import pytest

from ..conftest import read_metrics, run_here


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory):
    return tmp_path_factory.mktemp("datasets")  # styleshapes is generated there on first use


def _args(root, out, *extra):
    return ["--data", "styleshapes", "--data-root", str(root), "--out", str(out), "--rounds", "2",
            "--eval-every", "2", "--samples-per-client", "16", "--batch-size", "8", "--threads", "1", *extra]


@pytest.mark.parametrize("algo", ["fedavg", "fedprox", "fedavgm", "fedbn", "fedfa"])
def test_fedrdns_table_2_methods_run_two_rounds_with_fedrdn_and_report_dice(shapes_root, tmp_path, algo):
    job = run_here(*_args(shapes_root, tmp_path / "r", "--algo", algo, "--aug", "fedrdn"))
    assert job.returncode == 0, job.stderr
    records = read_metrics(tmp_path / "r")
    assert [r["round"] for r in records] == [1, 2] and set(records[0]["train"]) == {"loss", "dice"}
    kind = "personal" if algo == "fedbn" else "global"
    test = records[1]["eval"][kind]["test"]
    assert set(test["mean"]) == {"dice", "loss"} and 0 < test["mean"]["dice"] < 1
    assert set(test["domains"]) == {"flat", "texture", "mri", "outline", "blurred"}
    assert all(d["n"] == 40 and "acc" not in d for d in test["domains"].values())
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert f"### {kind} model: test Dice (%)" in summary
    assert "last_test_dice" in (tmp_path / "r" / "summary.csv").read_text().splitlines()[0]
    assert "round 2: mean test dice" in (tmp_path / "r" / "log.txt").read_text()


def test_a_method_that_needs_classes_refuses_a_segmentation_dataset_before_writing(shapes_root, tmp_path):
    job = run_here(*_args(shapes_root, tmp_path / "p", "--algo", "fedproto"))
    assert job.returncode == 2 and len(job.stderr.splitlines()) == 1
    assert "--algo fedproto averages class prototypes" in job.stderr and "styleshapes is a segmentation" in job.stderr
    assert not (tmp_path / "p").exists()


def test_elcfs_trains_a_segmentation_task_with_its_boundary_oriented_loss(shapes_root, tmp_path):
    plain = run_here(*_args(shapes_root, tmp_path / "off", "--algo", "elcfs", "--rounds", "1",
                            "--elcfs-boundary-weight", "0"))
    boundary = run_here(*_args(shapes_root, tmp_path / "on", "--algo", "elcfs", "--rounds", "1"))
    assert plain.returncode == 0 and boundary.returncode == 0, boundary.stderr
    off, on = read_metrics(tmp_path / "off")[0]["train"], read_metrics(tmp_path / "on")[0]["train"]
    assert on["loss"] > off["loss"] and 0 < on["dice"] < 1  # the same first batch, plus 0.1 L_boundary > 0


def test_a_label_skew_split_is_refused_on_masks(shapes_root, tmp_path):
    job = run_here(*_args(shapes_root, tmp_path / "d", "--dirichlet", "0.5", "--clients-per-domain", "2"))
    assert job.returncode == 2 and len(job.stderr.splitlines()) == 1 and not (tmp_path / "d").exists()
    assert "--dirichlet splits each domain by its images' classes; styleshapes is a segmentation" in job.stderr
