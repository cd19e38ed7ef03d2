"""Segmentation runs end to end on the generated ``styleshapes`` (U-Net, Dice): FedRDN's Table 2 methods with
``--aug fedrdn``, and a method whose rule needs classes refused in one line."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpifl.analysis import load_checkpointed
from mpifl.data.shard import Shard

from ..conftest import read_metrics, run_here

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory):
    return tmp_path_factory.mktemp("datasets")  # styleshapes is generated there on first use


def _args(root, out, *extra):
    return ["--data", "styleshapes", "--data-root", str(root), "--out", str(out), "--rounds", "2",
            "--eval-every", "2", "--samples-per-client", "16", "--batch-size", "8", "--threads", "1", *extra]


def _shard(cfg, spec) -> Shard:
    return Shard(Path(cfg.data_root) / "styleshapes" / f"{spec.domain}.h5")


def _own_statistics(cfg, spec):
    """FedRDN's (mu, sigma) of a client (eqs. 5-6), by hand: the mean over its training images of their
    per-image channel means and population channel stds, in [0, 1] units."""
    with _shard(cfg, spec) as shard:
        pixels = shard.load("train")[0][spec.rows["train"]]
    per_image = pixels.astype(np.float64).reshape(len(pixels), -1, pixels.shape[-1]) / 255
    return per_image.mean(1).mean(0), per_image.std(1).mean(0)


def _first_client_by_hand(run, reported, other_statistics=False):
    """Client 0's reported test Dice and Dice loss, by hand from the run's last checkpoint and the shard.

    FedRDN at test time (eq. 8): ``x = (p / 255 - mu) / sigma`` with the client's own statistics, ``mu`` the
    mean over its training images of their per-image channel means, ``sigma`` of their per-image population
    channel stds (eqs. 5-6; no --train-transforms, so the images as stored), applied as the runtime applies an
    affine, ``p * 1 / (255 sigma) + (-mu / sigma)`` in float32.  On its logits: the Dice score, the mean over
    images of the class-mean hard Dice ``2 |P_k & G_k| / (|P_k| + |G_k| + 1e-5)``, and the Dice loss,
    ``1 - mean_k (2 sum p_k y_k + 1e-5) / (sum p_k + sum y_k + 1e-5)`` over the split (one evaluation batch).
    ``other_statistics``: also show that the check tells the statistics apart (two more forward passes)."""
    ckpt = load_checkpointed(run)
    cfg, spec = ckpt.cfg, ckpt.session.clients[0]
    assert ckpt.round == 2 and cfg.aug == "fedrdn" and cfg.train_transforms == "none" and spec.trains
    own = _own_statistics(cfg, spec)
    with _shard(cfg, spec) as shard:
        images, masks = (a[spec.rows["test"]] for a in shard.load("test"))
    assert cfg.eval_batch_size >= len(images) and reported["n"] == len(images)
    model = ckpt.build(ckpt.personal_state(0))  # the shared entries + client 0's private ones

    def evaluate(mu, sigma):
        mean, std = torch.tensor(mu, dtype=torch.float32), torch.tensor(sigma, dtype=torch.float32)
        scale, shift = (1 / (255 * std)).reshape(1, 3, 1, 1), (-mean / std).reshape(1, 3, 1, 1)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the run (--threads 1): the same bits, and faster on shared cores
        try:
            with torch.no_grad():
                logits = model(torch.addcmul(shift, torch.from_numpy(images).permute(0, 3, 1, 2).float(), scale))
        finally:
            torch.set_num_threads(threads)
        probs = F.softmax(logits.double(), 1).numpy()
        pred = probs.argmax(1)
        classes = probs.shape[1]
        dice = np.mean([np.mean([2 * np.sum((p == k) & (g == k)) / (np.sum(p == k) + np.sum(g == k) + 1e-5)
                                 for k in range(classes)]) for p, g in zip(pred, masks)])
        loss = 1 - np.mean([(2 * probs[:, k][masks == k].sum() + 1e-5) / (probs[:, k].sum() + np.sum(masks == k) + 1e-5)
                            for k in range(classes)])
        margin = np.abs(np.diff(np.sort(logits.numpy(), 1)[:, -2:], axis=1)).min()
        return float(dice), float(loss), float(margin)

    dice, loss, margin = evaluate(*own)
    assert reported["loss"] == pytest.approx(loss, abs=1e-6)
    # a pixel whose two best logits (nearly) tie may go either way between two forward passes
    assert reported["dice"] == pytest.approx(dice, abs=1e-9 if margin > 1e-4 else 1e-3)
    if not other_statistics:
        return
    # the loss tells the statistics apart: all clients' mean statistics (FedRDN-v), or another client's
    # mean, would miss by far more than 1e-6
    everyone = [own] + [_own_statistics(cfg, other) for other in ckpt.session.clients[1:]]
    average = [np.mean([s[i] for s in everyone], 0) for i in (0, 1)]
    for mu, sigma in (average, (everyone[1][0], own[1])):
        assert abs(evaluate(mu, sigma)[1] - reported["loss"]) > 1e-5


@pytest.mark.parametrize("algo", ["fedavg", "fedprox", "fedavgm", "fedbn", "fedfa"])
def test_fedrdns_table_2_methods_run_two_rounds_with_fedrdn_and_report_dice(shapes_root, tmp_path, algo):
    by_hand = algo in ("fedavg", "fedbn")  # a global and a personal model; the others run the same evaluation
    job = run_here(*_args(shapes_root, tmp_path / "r", "--algo", algo, "--aug", "fedrdn",
                          *(("--ckpt-every", "2") if by_hand else ())))
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
    if by_hand:  # the reported numbers are the evaluated model's on the test shard under FedRDN's own statistics
        _first_client_by_hand(tmp_path / "r", test["clients"]["0"], other_statistics=algo == "fedavg")


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


def test_elcfs_runs_with_its_authors_sigmoid_dice_on_a_foreground_head(shapes_root, tmp_path):
    job = run_here(*_args(shapes_root, tmp_path / "s", "--algo", "elcfs", "--seg-loss", "sigmoid-dice",
                          "--ckpt-every", "2"))
    assert job.returncode == 0, job.stderr
    ckpt = load_checkpointed(tmp_path / "s")
    assert ckpt.session.build_model().classifier.out_channels == 1  # styleshapes: background and shape
    records = read_metrics(tmp_path / "s")
    assert np.isfinite(records[0]["train"]["loss"]) and 0 < records[1]["eval"]["global"]["test"]["mean"]["dice"] < 1
