import json

import pytest
import torch
from click.testing import CliRunner

from mpifl.algorithms import get_algorithm
from mpifl.analysis import bn_divergence, feature_similarity, load_checkpointed, pick_clients
from mpifl.analysis.__main__ import main
from mpifl.data import ensure_dataset
from mpifl.errors import MpiflError
from mpifl.models import build_model
from mpifl.plan.config import resolve
from mpifl.rundir.checkpoint import Checkpoint, commit, identity, save_clients, save_server
from mpifl.session.session import make_session

PNG = b"\x89PNG\r\n\x1a\n"


def make_checkpoint(run_dir, data_root, algo="fedbn", shift=0.1, **options):
    """A run directory with a round-1 checkpoint written by mpifl.rundir.checkpoint, without training: every client
    starts from the seeded initial model and client k's private BN running means are shifted by k * shift."""
    run_dir.mkdir(parents=True)
    declared = {o.name: o for o in get_algorithm(algo).options}
    cfg = resolve({"algo": algo, "model": "smallcnn", "data": "styledigits", "data_root": str(data_root),
                   "rounds": 1, "out": str(run_dir), **options}, {}, declared)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_flat()))
    session = make_session(cfg, ensure_dataset(data_root, "styledigits"), num_hosts=2)
    files = {"server.pt": save_server(run_dir, 1, session.algo.init_server(session.initial))}
    clients = {c.id: session.algo.init_client(c, session.initial) for c in session.clients}
    for cid, client in clients.items():
        for key, value in client.private.items():
            if key.endswith("running_mean"):
                value += cid * shift
    for h, ids in enumerate(session.placement):
        files[f"rank-{h + 1}.zip"] = save_clients(run_dir, 1, h + 1, [(c, clients[c].private) for c in ids], {})
    commit(run_dir, Checkpoint(round=1, clients=len(clients), ranks={h + 1: ids for h, ids in
                                                                     enumerate(session.placement)},
                               pending=None, identity=identity(cfg), files=files))
    return run_dir


def test_divergence_measures():
    mean, var = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 0.5])
    assert bn_divergence.divergence(mean, var, mean, var) == {"mean_rmsd": 0.0, "var_rmsd": 0.0, "sym_kl": 0.0}
    d = bn_divergence.divergence(torch.zeros(4), torch.ones(4), torch.full((4,), 0.3), torch.full((4,), 4.0))
    v1, v2 = 1 + bn_divergence.BN_EPS, 4 + bn_divergence.BN_EPS
    assert d["mean_rmsd"] == pytest.approx(0.3) and d["var_rmsd"] == pytest.approx(3.0)
    # symmetric KL of N(0, v1) and N(0.3, v2): ((v1 + 0.09) / v2 + (v2 + 0.09) / v1) / 4 - 1/2
    assert d["sym_kl"] == pytest.approx(((v1 + 0.09) / v2 + (v2 + 0.09) / v1) / 4 - 0.5)


def test_cosine_of_feature_maps():
    a = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    assert feature_similarity.cosine(a, a) == pytest.approx((1.0, 1.0))
    assert feature_similarity.cosine(a, -a) == pytest.approx((-1.0, -1.0))
    b = a.clone()
    b[:, 0] = 0  # a zero map has no direction: left out of the per-map mean
    assert feature_similarity.cosine(a, b)[0] == pytest.approx(1.0)


def test_last_conv_layer():
    assert feature_similarity.last_conv(build_model("digitmodel", num_classes=10, in_channels=3,
                                                    image_size=(28, 28))) == "conv3"


def test_bn_divergence_from_checkpointed_personal_models(tmp_path, data_root):
    ckpt = load_checkpointed(make_checkpoint(tmp_path / "run", data_root), device="cpu")
    assert pick_clients(ckpt, None) == [0, 1, 2, 3, 4]  # one per domain
    result = bn_divergence.compute(ckpt, [0, 1, 2], models="checkpoint")
    assert result.models == ["client 0 (mono)", "client 1 (outline)", "client 2 (paper)", "server"]
    rows = {(r["layer"], r["a"], r["b"]): r for r in result.rows}
    for layer in result.layers:
        assert rows[(layer, "client 0 (mono)", "client 1 (outline)")]["mean_rmsd"] == pytest.approx(0.1)
        assert rows[(layer, "client 0 (mono)", "client 2 (paper)")]["var_rmsd"] == pytest.approx(0.0)
        # FedBN's server has no BN: the average of the 5 training clients, shifted by (0+1+2+3+4)/5 * 0.1
        assert rows[(layer, "client 0 (mono)", "server")]["mean_rmsd"] == pytest.approx(0.2)
    assert "average of the 5 training clients" in result.note
    files = bn_divergence.write(result, tmp_path / "out", "fedbn")
    assert [f.name for f in files] == ["bn-divergence.csv", "bn-divergence.png", "bn-statistics.png"]
    assert all(f.read_bytes().startswith(PNG) and f.stat().st_size > 10_000 for f in files[1:])


def test_without_private_layers_checkpointed_clients_equal_the_global_model(tmp_path, data_root):
    ckpt = load_checkpointed(make_checkpoint(tmp_path / "run", data_root, algo="fedavg"), device="cpu")
    sim = feature_similarity.compute(ckpt, [0, 1], models="checkpoint", images=8)
    assert sim.layer == "conv3" and sim.summary() == pytest.approx({"C<->C": 1.0, "S<->C": 1.0})
    assert {r["images_of"] for r in sim.rows} == {"client 0 (mono)", "client 1 (outline)"}
    assert bn_divergence.compute(ckpt, [0, 1], models="checkpoint").summary()["C<->C"]["sym_kl"] == 0.0


def test_local_round_trains_each_client_from_the_checkpoint(tmp_path, data_root):
    ckpt = load_checkpointed(make_checkpoint(tmp_path / "run", data_root, shift=0.0), device="cpu")
    before = {k: v.clone() for k, v in ckpt.private[0].items()}
    local = ckpt.local_state(0)
    personal = ckpt.personal_state(0)
    assert not torch.equal(local["norm1.running_mean"], personal["norm1.running_mean"])  # statistics of its data
    assert not torch.equal(local["conv1.weight"], personal["conv1.weight"])  # trained weights
    assert all(torch.equal(before[k], ckpt.private[0][k]) for k in before)  # the checkpoint is left alone
    assert torch.equal(ckpt.local_state(0)["conv1.weight"], local["conv1.weight"])  # seeded: repeatable


def test_errors_are_one_line(tmp_path, data_root):
    ckpt = load_checkpointed(make_checkpoint(tmp_path / "won", data_root, algo="fedwon"), device="cpu")
    with pytest.raises(MpiflError, match="no BatchNorm layer with running statistics"):
        bn_divergence.compute(ckpt, [0], models="checkpoint")
    with pytest.raises(MpiflError, match="--clients"):
        pick_clients(ckpt, "0,9")
    run = make_checkpoint(tmp_path / "plain", data_root)
    (run / "checkpoint" / "round-1" / "rank-1.zip").write_bytes(b"cut")
    with pytest.raises(MpiflError) as damaged:
        load_checkpointed(run)
    message = str(damaged.value)
    assert "rank-1.zip has 3 bytes" in message and "there is nothing to analyse in it" in message
    assert "resume" not in message and "--out" not in message  # the analyses' own wording, not a resume's
    (run / "checkpoint" / "meta.json").unlink()
    with pytest.raises(MpiflError, match="no committed checkpoint in .*round-1/ was still being written .*nothing "
                                         "to analyse"):
        load_checkpointed(run)


def test_cli_writes_csv_and_png(tmp_path, data_root):
    run = make_checkpoint(tmp_path / "run", data_root)
    result = CliRunner().invoke(main, ["feature-similarity", str(run), "--models", "checkpoint", "--clients",
                                       "0,3", "--images", "4"])
    assert result.exit_code == 0, result.output
    assert "C<->C" in result.output
    assert sorted(p.name for p in (run / "analysis").iterdir()) == ["feature-similarity.csv",
                                                                    "feature-similarity.png"]
    bad = CliRunner().invoke(main, ["bn-divergence", str(tmp_path / "nothing")])
    assert bad.exit_code == 2 and bad.output.startswith("mpifl: error:")


def test_a_garbled_config_and_an_output_folder_that_cannot_be_written_are_one_line(tmp_path, data_root):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"algo": "fedbn", ')  # cut off
    result = CliRunner().invoke(main, ["bn-divergence", str(broken)])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"mpifl: error: cannot parse config file {broken / 'config.json'}: ")
    run = make_checkpoint(tmp_path / "run", data_root)
    (run / "analysis").write_text("in the way")  # as a read-only run: its default output folder cannot be made
    result = CliRunner().invoke(main, ["bn-divergence", str(run), "--models", "checkpoint"])
    assert result.exit_code == 2 and result.output == (
        f"mpifl: error: cannot write into {run / 'analysis'}: {run / 'analysis'} is a file; pass --out DIR to write "
        "the analysis elsewhere\n")
