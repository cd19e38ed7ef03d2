"""End-to-end runs: learning, outputs and manifests in the test process (no launcher, the in-process
transport); rank-count invariance over real ``mpirun``, equal to a run in a process of its own."""

from __future__ import annotations

import csv

import numpy as np

import pytest

from mpifl.algorithms import ALGORITHMS
from mpifl.server.run_log import fold_summary

from ..algorithms.helpers import own_options
from ..conftest import launch, read_metrics, run_here, run_in_process, untimed

pytestmark = pytest.mark.slow


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--out", str(out), "--lr", "0.05",
            "--momentum", "0.9", "--threads", "1", *extra]


def test_fedavg_three_rounds_learns_and_writes_outputs(data_root, tmp_path):
    run = tmp_path / "run"
    job = run_here(*_args(data_root, run, "--rounds", "3"))
    assert job.returncode == 0, job.stderr
    records = read_metrics(run)
    assert [r["round"] for r in records] == [1, 2, 3]
    accs = [r["eval"]["global"]["test"]["mean"]["acc"] for r in records]
    assert accs[-1] > accs[0] and accs[-1] > 0.3, accs  # 10 classes: chance is 0.1
    assert set(records[-1]["eval"]["global"]["test"]["domains"]) == {"mono", "paper", "street", "texture", "outline"}
    assert records[0]["bytes"]["down"] == records[0]["bytes"]["up"] > 0
    assert {"round", "compute", "data", "communication", "waiting", "waiting_cpu", "evaluation",
            "aggregation"} == set(records[0]["seconds"])
    for record in records:  # the client host's own seconds; its transport time: the broadcast, the uploads
        assert set(record["rank_seconds"]) == {"compute", "data", "evaluation", "communication", "waiting"}
        assert all(len(v) == 1 and v[0] >= 0 for v in record["rank_seconds"].values())
        assert record["rank_seconds"]["compute"][0] == record["seconds"]["compute"] > 0
        assert record["memory"]["peak_gpu"] == [0, 0]  # on the CPU
    peaks = [r["memory"]["peak_rss"] for r in records]  # rank 0 and the client host, bytes, never falling
    assert all(len(p) == 2 and min(p) > 10 << 20 for p in peaks) and peaks == sorted(peaks)
    rows = list(csv.DictReader((run / "summary.csv").open()))
    assert sorted(r["domain"] for r in rows) == ["mean", "mono", "outline", "paper", "street", "texture"]
    summary = (run / "summary.md").read_text()
    assert "| mean |" in summary and "best val" in summary
    assert (run / "config.json").exists() and (run / "log.txt").exists()
    assert "round 3/3" in job.stdout


def _numbers(records):
    """Everything but timings and memory: must not depend on the number of ranks."""
    return [{k: v for k, v in r.items() if k != "bytes"} | {"bytes": {
        k: v for k, v in r["bytes"].items() if not k.startswith("wire")}} for r in untimed(records)]


@pytest.mark.parametrize("aug,ranks", [("none", (2, 3, 5)), ("fedrdn", (3,))])
def test_same_numbers_in_process_and_for_2_3_and_5_ranks(data_root, tmp_path, aug, ranks):
    """FedRDN's statistics exchange is checked on one placement only: 5 ranks on 2 cores take 20 s.  Rank 0 of the
    3-rank runs folds on 2 threads (each half of smallcnn's blocks)."""
    extra = ("--rounds", "2", "--clients-per-domain", "2", "--fraction", "0.5", "--seed", "7", "--threads", "1",
             "--aug", aug)
    job = run_in_process(*_args(data_root, tmp_path / "in-process", *extra))
    assert job.returncode == 0, job.stderr
    in_process = read_metrics(tmp_path / "in-process")
    results = {}
    for n in ranks:
        job = launch(n, *_args(data_root, tmp_path / f"n{n}", *extra, *("--fold-threads", "2") * (n == 3)))
        assert job.returncode == 0, job.stderr
        results[n] = _numbers(read_metrics(tmp_path / f"n{n}"))
    assert all(numbers == _numbers(in_process) for numbers in results.values())
    assert len(results[ranks[0]][0]["clients"]) == 5  # 10 clients, fraction 0.5
    if 2 in ranks:  # one client host, as in one process: the wire bytes too
        assert untimed(in_process) == untimed(read_metrics(tmp_path / "n2"))
    assert "folds the uploads on 2 threads behind its receives" in (tmp_path / "n3" / "log.txt").read_text()


@pytest.mark.parametrize("algo,ranks", [("gperxan", (2, 3, 4)), ("fednn", (4,))])
def test_a_held_out_domain_is_evaluated_by_every_client_rank_to_the_same_numbers(data_root, tmp_path, algo, ranks):
    """The global model's batches, the held-out domain's 1,100 images among them, spread over 1, 2 and 3 client
    ranks within a batch (gPerXAN's personal models stay on their hosts); FedNN's Gumbel draws keep each client's
    evaluation whole on one rank.  Numbers as in one process."""
    extra = ("--algo", algo, "--holdout", "street", "--rounds", "2", "--seed", "7", "--threads", "1",
             "--samples-per-client", "64", "--eval-batch-size", "64")
    job = run_in_process(*_args(data_root, tmp_path / "in-process", *extra))
    assert job.returncode == 0, job.stderr
    in_process = _numbers(read_metrics(tmp_path / "in-process"))
    assert in_process[-1]["eval"]["global"]["test"]["domains"]["street"]["n"] == 1100
    for n in ranks:
        job = launch(n, *_args(data_root, tmp_path / f"n{n}", *extra, *("--fold-threads", "2") * (n == 3)))
        assert job.returncode == 0, job.stderr
        assert _numbers(read_metrics(tmp_path / f"n{n}")) == in_process
        evaluated = [int(line.split("; evaluates ")[1].split(" images")[0].replace(",", ""))
                     for line in (tmp_path / f"n{n}" / "log.txt").read_text().splitlines()
                     if line.startswith("rank ") and "; evaluates " in line]
        assert len(evaluated) == n - 1 and sum(evaluated) == 1100 + 4 * 300 * (1 + (algo == "gperxan"))
        assert algo == "fednn" or max(evaluated) - min(evaluated) <= 64
        assert all(seconds > 0 for seconds in read_metrics(tmp_path / f"n{n}")[-1]["rank_seconds"]["evaluation"])


def test_log_names_every_round_once_with_the_evaluation_it_knows(data_root, tmp_path):
    job = run_here(*_args(data_root, tmp_path / "r", "--rounds", "3", "--eval-every", "2", "--samples-per-client",
                          "64"))
    assert job.returncode == 0, job.stderr
    lines = [l for l in (tmp_path / "r" / "log.txt").read_text().splitlines() if l.startswith("round ")]
    assert [l.split(":")[0] for l in lines] == ["round 1", "round 2", "round 3"]
    acc = {r["round"]: r["eval"]["global"]["test"]["mean"]["acc"] for r in read_metrics(tmp_path / "r") if "eval" in r}
    assert sorted(acc) == [2, 3] and lines[0] == "round 1: not evaluated yet"
    assert lines[1:] == [f"round {r}: mean test acc {acc[r]:.4f} (round {r})" for r in (2, 3)]


def test_singleset_evaluates_personal_models(data_root, tmp_path):
    job = run_here(*_args(data_root, tmp_path / "s", "--algo", "singleset", "--rounds", "2", "--samples-per-client",
                          "64"))
    assert job.returncode == 0, job.stderr
    record = read_metrics(tmp_path / "s")[-1]
    assert set(record["eval"]) == {"personal"}
    assert record["bytes"]["down"] == record["bytes"]["up"] == 0


def test_fedprox_runs_from_a_yaml_config_with_cli_override(data_root, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("algo: fedprox\nmu: 0.1\nrounds: 5\n")
    job = run_here(*_args(data_root, tmp_path / "p", "--config", str(config), "--rounds", "1"))
    assert job.returncode == 0, job.stderr
    import json
    resolved = json.loads((tmp_path / "p" / "config.json").read_text())
    assert resolved["algo"] == "fedprox" and resolved["mu"] == 0.1 and resolved["rounds"] == 1
    assert len(read_metrics(tmp_path / "p")) == 1


def test_show_manifest_lists_the_wire_tensors(data_root):
    job = run_here("--data-root", str(data_root), "--model", "digitmodel", "--show-manifest")
    assert job.returncode == 0, job.stderr
    out = job.stdout
    assert "download (server -> client): 32 tensors" in out  # 37 state entries minus 5 BN step counters
    assert "num_batches_tracked" not in out.split("kept on the client")[0]
    assert "fc1.weight" in out and "[2048, 6272]" in out and "float32" in out
    per_client = 14_219_210 * 4 + 2 * 4 * (64 + 64 + 128 + 2048 + 512)  # params + BN running stats
    assert f"{per_client:,} bytes per client" in out
    single = run_here("--data-root", str(data_root), "--algo", "singleset", "--show-manifest")
    assert "download (server -> client): 0 tensors, 0 bytes" in single.stdout


def test_show_manifest_of_holdout_all_shows_each_fold(data_root):
    job = run_here("--data-root", str(data_root), "--holdout", "all", "--show-manifest")
    assert job.returncode == 0, job.stderr
    folds = job.stdout.split("fold holdout-")[1:]
    assert [fold.split(" ", 1)[0] for fold in folds] == ["mono", "outline", "paper", "street", "texture"]
    assert all("clients: 5 over 5 domains, 4 per round" in fold for fold in folds)  # 4 train, 1 held out


def test_show_manifest_names_kept_optimizer_state_only_when_kept(data_root):
    line = "optimizer/<parameter>/<name>: with --keep-optimizer, the local sgd optimizer's state"
    kept = run_here("--data-root", str(data_root), "--momentum", "0.9", "--keep-optimizer", "--show-manifest")
    assert kept.returncode == 0 and line in kept.stdout.split("kept on the client, never sent")[1]
    fresh = run_here("--data-root", str(data_root), "--momentum", "0.9", "--show-manifest")
    assert fresh.returncode == 0 and "optimizer/" not in fresh.stdout


def test_show_manifest_of_absent_data_is_one_line(tmp_path):
    job = run_here("--data", "pacs", "--data-root", str(tmp_path), "--show-manifest")
    assert job.returncode == 2 and job.stdout == ""
    assert job.stderr.startswith("mpifl: error: dataset 'pacs' not found") and len(job.stderr.splitlines()) == 1


def test_holdout_all_runs_every_fold_and_tabulates_targets(data_root, tmp_path):
    fold = ("--samples-per-client", "64", "--ckpt-every", "1")
    job = run_here(*_args(data_root, tmp_path / "lodo", "--holdout", "all", "--rounds", "1", *fold))
    assert job.returncode == 0, job.stderr
    folds = sorted(p.name for p in (tmp_path / "lodo").iterdir() if p.is_dir())
    assert folds == ["holdout-mono", "holdout-outline", "holdout-paper", "holdout-street", "holdout-texture"]
    record = read_metrics(tmp_path / "lodo" / "holdout-street")[0]
    assert len(record["clients"]) == 4 and 3 not in record["clients"]  # street is client 3, it never trains
    test = record["eval"]["global"]["test"]
    assert test["domains"]["street"]["n"] == 1100  # every image of the held-out domain
    assert abs(test["mean"]["acc"] - np.mean([test["domains"][d]["acc"] for d in
                                              ("mono", "outline", "paper", "texture")])) < 1e-12
    table = (tmp_path / "lodo" / "summary.md").read_text()
    assert "| best source val |" in table
    # one fold continued, as --resume of the folder says: the folder's table is made again from every fold's
    # summary (at 64 images a fold stays at chance, so the table is first marked stale to tell it was rewritten)
    (tmp_path / "lodo" / "summary.md").write_text("stale\n")
    resumed = run_here("--resume", str(tmp_path / "lodo" / "holdout-street"), "--rounds", "2", "--data-root",
                       str(data_root))
    assert resumed.returncode == 0, resumed.stderr
    folds = {d: tmp_path / "lodo" / f"holdout-{d}" for d in ("mono", "outline", "paper", "street", "texture")}
    assert (tmp_path / "lodo" / "summary.md").read_text() == fold_summary(folds)
    assert read_metrics(folds["street"])[-1]["round"] == 2
    assert "now holds this fold's numbers" in resumed.stdout


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_every_algorithm_completes_two_rounds_and_moves_only_its_manifest(data_root, style_model, tmp_path, algo):
    """10 clients, half of them per round: partial participation for every method, in one process; 16 training
    images per client (the bytes do not depend on them; learning is checked by the first test here)."""
    run = tmp_path / algo
    sampling = ("--clients-per-domain", "2", "--fraction", "0.5", "--samples-per-client", "16", "--batch-size", "8",
                *own_options(algo, style_model))
    job = run_here(*_args(data_root, run, "--algo", algo, "--rounds", "2", *sampling))
    assert job.returncode == 0, job.stderr
    manifest = run_here(*_args(data_root, tmp_path / "m", "--algo", algo, "--show-manifest", *sampling))
    per_client = [int(line.split(" bytes per client")[0].rsplit(" ", 1)[1].replace(",", ""))
                  for line in manifest.stdout.splitlines() if "bytes per client," in line]
    gathered = int(manifest.stdout.split("gathered whole by rank 0")[1].split(" tensors, ")[1].split(" bytes")[0]
                   .replace(",", ""))
    header, meta, report = 3 * 8, 8 * 8, 5 * 8 + 8 + 8 + 8 + 8 + 32  # round header, client.meta, the rank's report
    kinds = tuple(read_metrics(run)[0]["eval"])  # the models the run evaluates (gPerXAN: only personal ones)
    # the global model's 20 batches (10 clients' val and test, under 512 images each): (loss, score); per client a
    # block of personal kinds x (val, test) x (loss, score, n)
    scores = 20 * 2 * 8 * ("global" in kinds) + 10 * (len(kinds) - ("global" in kinds)) * 2 * 3 * 8
    method = ALGORITHMS[algo]  # an asynchronous one steps on each buffer of arrivals (FedAsync's holds one)
    uploads = {o.name: o.default for o in method.options}.get("buffer_size", 1) if method.asynchronous else 5
    for record in read_metrics(run):
        k = len(record["clients"])
        trained = len(record.get("sim", {}).get("trained", record["clients"]))  # asynchronous: who started on it
        assert record["bytes"]["down"] == per_client[0] * trained and record["bytes"]["up"] == per_client[1] * k
        assert record["bytes"]["wire_down"] == padded(per_client[0] + header)  # to the one client host
        assert k == uploads
        evaluated = record["round"] > 1  # round r's message carries round r-1's evaluation
        assert record["bytes"]["wire_up"] == (report + k * padded(gathered + meta) + evaluated * scores
                                              + k * padded(per_client[1] - gathered))  # the gather, then the rest


def test_gperxan_selects_the_best_round_by_its_clients_post_training_validation(data_root, tmp_path):
    run = tmp_path / "g"
    job = run_here(*_args(data_root, run, "--algo", "gperxan", "--rounds", "2", "--samples-per-client", "64"))
    assert job.returncode == 0, job.stderr
    local = [r["train"]["local_val_acc"] for r in read_metrics(run)]
    assert len(local) == 2 and all(0 <= a <= 1 for a in local)
    rows = list(csv.DictReader((run / "summary.csv").open()))
    assert {r["selection"] for r in rows} == {"local-val"}
    assert {int(r["best_round"]) for r in rows} == {1 + int(local[1] > local[0])}


def padded(nbytes: int) -> int:
    """A message layout's size on the wire: its tensors' bytes rounded up to a multiple of 8 (mpifl.transport.wire)."""
    return -(-nbytes // 8) * 8


def test_fedrdn_adds_only_channel_statistics_to_the_wire(data_root, tmp_path):
    base = run_here(*_args(data_root, tmp_path / "m", "--show-manifest")).stdout.splitlines()
    rdn = run_here(*_args(data_root, tmp_path / "m", "--show-manifest", "--aug", "fedrdn")).stdout.splitlines()
    extra = [line for line in rdn if line not in base]
    assert len(extra) == 1 and extra[0].startswith("setup exchange, once before round 1: 5 clients")
    assert "fedrdn.stats [2, 3] float64 (48 bytes)" in extra[0] and "[5, 2, 3] (240 bytes)" in extra[0]


def test_fixbn_stops_sending_bn_statistics_after_its_first_stage(data_root, tmp_path):
    job = run_here(*_args(data_root, tmp_path / "fx", "--algo", "fixbn", "--rounds", "4", "--fixbn-stage-rounds",
                          "2", "--lr", "0.01", "--momentum", "0", "--samples-per-client", "16"))
    assert job.returncode == 0, job.stderr
    stats = 4 * 2 * (16 + 32 + 64)  # SmallCNN: running mean and var of its three BN layers, float32
    down = [r["bytes"]["down"] // 5 for r in read_metrics(tmp_path / "fx")]
    up = [r["bytes"]["up"] // 5 for r in read_metrics(tmp_path / "fx")]
    assert down[0] == down[1] == down[2] == up[0] == up[1] and up[2] == down[3] == up[3] == down[0] - stats


@pytest.mark.parametrize("algo,extra", [
    ("fedwon", ("--batch-size", "1", "--clients-per-domain", "4", "--fraction", "0.25")),
    ("fedwon", ("--clients-per-domain", "4", "--fraction", "0.5")),
    ("fednn", ("--clients-per-domain", "4", "--fraction", "0.5")),
])
def test_cross_device_and_batch_size_one(data_root, tmp_path, algo, extra):
    job = run_here(*_args(data_root, tmp_path / "r", "--algo", algo, "--rounds", "2", "--samples-per-client", "32",
                          *extra))
    assert job.returncode == 0, job.stderr
    records = read_metrics(tmp_path / "r")
    per_round = 5 if "0.25" in extra else 10
    assert all(len(r["clients"]) == per_round for r in records)
    assert len(records[-1]["eval"]["global"]["test"]["clients"]) == 20


def test_pretrained_checkpoint_initialises_the_model(data_root, tmp_path):
    import torch

    from mpifl.models import build_model
    torch.save(build_model("smallcnn", num_classes=7).state_dict(), tmp_path / "ckpt.pt")
    job = run_here(*_args(data_root, tmp_path / "r", "--rounds", "1", "--pretrained", str(tmp_path / "ckpt.pt")))
    assert job.returncode == 0, job.stderr
    log = (tmp_path / "r" / "log.txt").read_text()
    assert "loaded 21 entries, 2 kept their init" in log and "classifier of another size skipped" in log


def test_dirichlet_label_skew_over_n_clients(data_root, tmp_path):
    job = run_here(*_args(data_root, tmp_path / "d", "--rounds", "1", "--num-clients", "8", "--dirichlet", "0.5"))
    assert job.returncode == 0, job.stderr
    record = read_metrics(tmp_path / "d")[0]
    assert len(record["clients"]) == 8
    test = record["eval"]["global"]["test"]
    assert {d: v["n"] for d, v in test["domains"].items()} == {d: 200 for d in test["domains"]}  # parts cover
