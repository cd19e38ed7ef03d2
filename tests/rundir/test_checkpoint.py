"""Checkpoint and resume: a resumed run repeats the uninterrupted one bit for bit."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import zipfile

import pytest
import torch

from mpifl.algorithms import ServerState, get_algorithm
from mpifl.data.manifest import sha256_file
from mpifl.data.shard import SPLITS, Shard, ShardWriter
from mpifl.errors import MpiflError
from mpifl.job.cli import configuration
from mpifl.plan.config import CORE_KEYS, RESUMABLE, RunConfig
from mpifl.run import main
from mpifl.rundir.checkpoint import (Checkpoint, FileRecord, commit, identity, load, load_adopted, load_clients,
                                    save_clients, save_server, verify)

from ..conftest import TIMING_KEYS, launch, read_metrics, run_here, run_in_process
from .test_directory import one_error, snapshot

ALGO = "fedbn"  # private BN layers: the client ranks' state must survive the restart too


def _args(data_root, out, *extra):
    return ["--data-root", str(data_root), "--model", "smallcnn", "--algo", ALGO, "--threads", "1",
            "--fraction", "0.6", "--eval-every", "2", "--out", str(out), *extra]


def numbers(run_dir) -> list[dict]:
    """metrics.jsonl without what may differ between identical computations: timings, memory and MPI framing
    bytes."""
    out = []
    for record in read_metrics(run_dir):
        for key in TIMING_KEYS:
            record.pop(key)
        record["bytes"] = {k: record["bytes"][k] for k in ("down", "up")}
        out.append(record)
    return out


@pytest.fixture(scope="module")
def uninterrupted(data_root, tmp_path_factory):
    run = tmp_path_factory.mktemp("full") / "run"
    job = launch(3, *_args(data_root, run, "--rounds", "6"))
    assert job.returncode == 0, job.stderr
    return numbers(run)


@pytest.mark.slow
def test_three_rounds_then_resume_on_another_rank_count_equals_six_rounds(data_root, tmp_path, uninterrupted):
    run = tmp_path / "run"
    first = launch(3, *_args(data_root, run, "--rounds", "3", "--ckpt-every", "3"))
    assert first.returncode == 0, first.stderr
    assert json.loads((run / "checkpoint" / "meta.json").read_text())["round"] == 3
    resumed = launch(4, "--resume", str(run), "--rounds", "6")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after round 3" in resumed.stdout and "were on 2 client ranks, now placed on 3" in resumed.stdout
    assert numbers(run) == uninterrupted
    assert json.loads((run / "config.json").read_text())["rounds"] == 6


@pytest.mark.slow
def test_a_stop_signal_checkpoints_and_the_resumed_run_finishes_identically(data_root, tmp_path, uninterrupted):
    """Stopped over MPI after round 3, resumed in one process and stopped there after round 5, resumed over MPI:
    the uninterrupted numbers.  (Odd rounds: an evaluated round's record waits in the checkpoint for its scores.)"""
    run = tmp_path / "run"

    def stopped_after(done: int, job) -> None:
        assert job.returncode == 75, job.stderr
        assert job.lines(f"mpifl: stopped by SIGTERM after round {done}") and "Traceback" not in job.stderr
        assert [r["round"] for r in read_metrics(run)] == list(range(1, done + 1))
        assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["meta.json", f"round-{done}"]

    stopped_after(3, launch(3, *_args(data_root, run, "--rounds", "6"), env={"MPIFL_FAULT": "stop:rank=0,round=3"}))
    stopped_after(5, run_in_process("--resume", str(run), env={"MPIFL_FAULT": "stop:rank=0,round=5"}))
    resumed = launch(3, "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert numbers(run) == uninterrupted


@pytest.mark.slow
def test_a_crash_after_a_checkpoint_leaves_it_intact_and_resumable(data_root, tmp_path, uninterrupted):
    run = tmp_path / "run"
    crashed = launch(3, *_args(data_root, run, "--rounds", "6", "--ckpt-every", "2"),
                     env={"MPIFL_FAULT": "raise:rank=0,round=4"})
    assert crashed.returncode != 0
    assert json.loads((run / "checkpoint" / "meta.json").read_text())["round"] == 2
    assert not list((run / "checkpoint").glob("round-*/*.tmp"))
    resumed = launch(3, "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert numbers(run) == uninterrupted  # rounds logged after the checkpoint were dropped and redone


@pytest.fixture(scope="module")
def checkpointed(data_root, tmp_path_factory):
    """A finished 2-round run checkpointed after round 2 (in this process); tests damage copies of it."""
    run = tmp_path_factory.mktemp("checkpointed") / "run"
    job = run_here(*_args(data_root, run, "--rounds", "2", "--ckpt-every", "2"))
    assert job.returncode == 0, job.stderr
    return run


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.slow
def test_the_command_that_started_a_run_plus_resume_continues_it(data_root, checkpointed, tmp_path):
    run = _copy(checkpointed, tmp_path)
    config = tmp_path / "exp.yaml"
    config.write_text("algo: fedbn\nfraction: 0.6\n")
    job = run_here(*_args(data_root, run, "--config", str(config), "--resume", str(run), "--rounds", "3"))
    assert job.returncode == 0, job.stderr
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("extra,named", [
    (("--lr", "0.5"), "--lr 0.5 (the run has 0.01)"),
    (("--algo", "fedavg", "--seed", "3"), "--algo fedavg (the run has fedbn), --seed 3 (the run has 0)"),
    (("--out", "elsewhere"), "--out elsewhere (the run has "),
])
def test_resume_refuses_a_real_change_naming_it_and_changes_nothing(checkpointed, tmp_path, extra, named):
    run = _copy(checkpointed, tmp_path)
    before = snapshot(run)
    job = run_here("--resume", str(run), *extra)
    assert job.returncode == 2
    may_change = ", ".join("--" + key.replace("_", "-") for key in RESUMABLE)
    one_error(job, "this command changes " + named, f"(only {may_change} may change)")
    assert snapshot(run) == before


@pytest.mark.slow
@pytest.mark.parametrize("damage,named", [
    (lambda rd: rd.joinpath("server.pt").write_bytes(rd.joinpath("server.pt").read_bytes()[:5000]),
     "server.pt has 5000 bytes, "),
    (lambda rd: rd.joinpath("rank-1.zip").unlink(), "rank-1.zip is missing"),
    (lambda rd: rd.joinpath("rank-1.zip").write_bytes(rd.joinpath("rank-1.zip").read_bytes()[::-1]),
     "rank-1.zip differs from what was written (sha256)"),
    (lambda rd: rd.parent.joinpath("meta.json").write_text(rd.parent.joinpath("meta.json").read_text()[:40]),
     "meta.json is unreadable (JSONDecodeError"),
])
def test_a_damaged_checkpoint_is_named_before_anything_is_touched(checkpointed, tmp_path, damage, named):
    run = _copy(checkpointed, tmp_path)
    damage(run / "checkpoint" / "round-2")
    before = snapshot(run)
    job = run_here("--resume", str(run), "--rounds", "3")
    assert job.returncode == 2
    one_error(job, str(run / "checkpoint"), named, "cannot be resumed")
    assert snapshot(run) == before  # the finished run's metrics.jsonl keeps its last record


@pytest.mark.slow
def test_resume_without_a_checkpoint_or_past_its_rounds_is_refused_and_changes_nothing(checkpointed, tmp_path):
    run = _copy(checkpointed, tmp_path)
    before = snapshot(run)
    for rounds in ("2", "1"):
        job = run_here("--resume", str(run), "--rounds", rounds)
        assert job.returncode == 2
        one_error(job, "is checkpointed after round 2; pass --rounds above 2")
        assert snapshot(run) == before  # config.json still says 2 rounds
    (run / "checkpoint" / "meta.json").unlink()  # a run that ended while its first checkpoint was being written
    before = snapshot(run)
    job = run_here("--resume", str(run), "--rounds", "3")
    assert job.returncode == 2
    one_error(job, f"no committed checkpoint in {run}: checkpoint/round-2/ was still being written when the run "
                   "ended (no checkpoint/meta.json commits it); it can only be run again from the start")
    assert snapshot(run) == before
    shutil.rmtree(run / "checkpoint")
    before = snapshot(run)
    job = run_here("--resume", str(run), "--rounds", "3")
    assert job.returncode == 2
    one_error(job, f"no checkpoint in {run} (no checkpoint/meta.json): it was run without --ckpt-every")
    assert snapshot(run) == before


def _cfg(**kw):
    return RunConfig(**kw, algo_options={"mu": 0.01})


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    commit_to = tmp_path / "checkpoint"
    commit_to.mkdir()
    commit(tmp_path, Checkpoint(round=2, clients=5, ranks={1: [0]}, pending=None, identity=identity(_cfg()), files={}))
    assert load(tmp_path, _cfg(), 5).round == 2
    with pytest.raises(MpiflError, match="another run .*algo 'fedavg' vs 'fedprox'"):
        load(tmp_path, _cfg(algo="fedprox"), 5)
    with pytest.raises(MpiflError, match="5 clients, this run 6"):
        load(tmp_path, _cfg(), 6)


def test_files_round_trip_and_commit_keeps_only_the_named_round(tmp_path):
    adopted = {"bn.running_mean": (3, torch.tensor([0.25, 0.5]))}
    for r in (2, 4):
        states = iter([(0, {"p": torch.tensor([r, 0.5])}), (2, {"p": torch.tensor([r, 2.5])})])
        files = {"server.pt": save_server(tmp_path, r, ServerState(model={"w": torch.full((2,), float(r))},
                                                                   extra={"m": torch.ones(1)})),
                 "rank-1.zip": save_clients(tmp_path, r, 1, states, adopted),
                 "rank-2.zip": save_clients(tmp_path, r, 2, [(3, {"p": torch.tensor([r, 1.5])})], adopted)}
        commit(tmp_path, Checkpoint(round=r, clients=5, ranks={1: [0, 1, 2], 2: [3, 4]}, pending={"round": r},
                                    identity=identity(_cfg()), files=files))
    assert [p.name for p in (tmp_path / "checkpoint").glob("round-*")] == ["round-4"]
    meta = load(tmp_path, _cfg(), 5)
    verify(tmp_path, meta)  # sizes and sha256 computed while writing are those of the files
    for name in ("rank-1.zip", "rank-2.zip"):
        path = tmp_path / "checkpoint/round-4" / name
        assert meta.files[name] == FileRecord(path.stat().st_size, sha256_file(path))
    assert meta.pending == {"round": 4}
    loaded = list(load_clients(tmp_path, meta, [4, 3, 2, 1, 0]))  # clients 1 and 4 never trained: nothing saved
    assert [cid for cid, _ in loaded] == [0, 2, 3]
    assert [state["p"].tolist() for _, state in loaded] == [[4, 0.5], [4, 2.5], [4, 1.5]]
    (r, value), = load_adopted(tmp_path, meta).values()
    assert r == 3 and torch.equal(value, torch.tensor([0.25, 0.5]))


def _build(*args):
    """The RunConfig the command line ``args`` resolves to (what config.json stores)."""
    return configuration(args)[0]


def test_a_resume_with_more_rounds_keeps_the_schedules_of_the_rounds_the_run_started_with(tmp_path):
    """FixBN's default T is half of R, and R = --rounds of the first start, stored: 4 // 2, not 10 // 2."""
    first = _build("--algo", "fixbn", "--rounds", "4", "--out", str(tmp_path))
    assert first.schedule_rounds == 4
    (tmp_path / "config.json").write_text(json.dumps(first.to_flat()))
    resumed = _build("--resume", str(tmp_path), "--rounds", "10")
    assert (resumed.rounds, resumed.schedule_rounds) == (10, 4)
    assert get_algorithm("fixbn")(resumed, []).stage_rounds == 2
    with pytest.raises(MpiflError, match=r"changes --schedule-rounds 10 \(the run has 4\)"):
        _build("--resume", str(tmp_path), "--rounds", "10", "--schedule-rounds", "10")
    assert identity(resumed)["schedule_rounds"] == 4  # and a checkpoint records it


def test_one_list_says_what_a_resume_may_change_and_the_rest_is_the_checkpoints_identity(tmp_path):
    """RESUMABLE is the one list: --resume's help names exactly its options, the checkpoint records every other
    option (method options too, not --out), a change of a resumable one is accepted and any other refused."""
    assert set(identity(_cfg())) == (set(CORE_KEYS) - set(RESUMABLE) - {"out"}) | {"mu"}
    help_text = next(p.help for p in main.params if p.name == "resume")
    named = help_text.split("only ", 1)[1].split(" may change", 1)[0].split(", ")
    assert named == ["--" + key.replace("_", "-") for key in RESUMABLE]
    commit_to = tmp_path / "checkpoint"
    commit_to.mkdir()
    commit(tmp_path, Checkpoint(round=2, clients=5, ranks={1: [0]}, pending=None, identity=identity(_cfg()), files={}))
    moved = _cfg(threads=3, rounds=50, data_root="elsewhere", deterministic=True, out="moved")
    assert load(tmp_path, moved, 5).round == 2
    with pytest.raises(MpiflError, match="another run .*lr 0.01 vs 0.1"):
        load(tmp_path, _cfg(lr=0.1), 5)
    first = _build("--algo", "fedprox", "--rounds", "4", "--out", str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(first.to_flat()))
    assert _build("--resume", str(tmp_path), "--threads", "2", "--deterministic").threads == 2
    with pytest.raises(MpiflError, match=r"changes --precision bf16 \(the run has fp32\)"):
        _build("--resume", str(tmp_path), "--precision", "bf16")


@pytest.mark.slow
def test_kept_optimizer_state_is_checkpointed_resumes_bit_for_bit_and_never_crosses_the_wire(data_root, tmp_path,
                                                                                             uninterrupted):
    keep = ("--momentum", "0.9", "--keep-optimizer")
    full = run_here(*_args(data_root, tmp_path / "full", "--rounds", "3", *keep))
    assert full.returncode == 0, full.stderr
    run = tmp_path / "run"
    first = run_here(*_args(data_root, run, "--rounds", "2", "--ckpt-every", "2", *keep))
    assert first.returncode == 0, first.stderr
    with zipfile.ZipFile(run / "checkpoint" / "round-2" / "rank-1.zip") as archive:
        saved = [torch.load(io.BytesIO(archive.read(name)), weights_only=True) for name in archive.namelist()
                 if name.startswith("client-")]
    assert any(k.startswith("optimizer/") and k.endswith("/momentum_buffer") for state in saved for k in state)
    resumed = run_here("--resume", str(run), "--rounds", "3")
    assert resumed.returncode == 0, resumed.stderr
    assert numbers(run) == numbers(tmp_path / "full")
    assert [r["bytes"] for r in numbers(run)] == [r["bytes"] for r in uninterrupted[:3]]  # the same as without


def _build_with_one_shard_changed(data_root, root):
    """Another build of styledigits under ``root``: one pixel of mono's training images differs, its shard written
    and the manifest updated as prepare writes them."""
    shutil.copytree(data_root / "styledigits", root / "styledigits")
    shard = root / "styledigits" / "mono.h5"
    with Shard(shard) as old:
        data = {split: old.load(split) for split in SPLITS}
        layout = dict(dataset=old.dataset, domain=old.domain, classes=old.classes, image_size=old.image_size,
                      channels=old.channels, source=old.source, task=old.task)
    data["train"][0][0, 0, 0, 0] ^= 1
    with ShardWriter(shard, **layout) as writer:
        for split, (images, labels) in data.items():
            writer.add(split, images, labels)
    with Shard(shard) as new:
        content = new.content
    manifest = json.loads((root / "styledigits" / "manifest.json").read_text())
    manifest["shards"]["mono"].update(sha256=sha256_file(shard), bytes=shard.stat().st_size, content=content)
    (root / "styledigits" / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_a_resume_on_another_build_of_the_data_is_refused_and_a_moved_copy_is_not(checkpointed, data_root, tmp_path):
    run = _copy(checkpointed, tmp_path)
    before = snapshot(run)
    other = _build_with_one_shard_changed(data_root, tmp_path / "other")
    job = run_here("--resume", str(run), "--rounds", "3", "--data-root", str(other))
    assert job.returncode == 2
    one_error(job, f"checkpoint in {run} was taken on another build of styledigits than the one in --data-root "
                   f"{other} (other shards of mono (content sha256)); resume with the data the run started on")
    assert snapshot(run) == before
    moved = tmp_path / "moved"
    shutil.copytree(data_root / "styledigits", moved / "styledigits")  # the same build elsewhere: --data-root may move
    job = run_here("--resume", str(run), "--rounds", "3", "--data-root", str(moved))
    assert job.returncode == 0, job.stderr


def test_a_shard_of_another_build_copied_into_the_data_is_refused_by_a_resume_and_by_a_new_run(checkpointed, data_root,
                                                                                            tmp_path):
    """cp -r DA DAx; cp DC/.../mono.h5 DAx/.../mono.h5: the same domain, counts and file length, DA's manifest."""
    run = _copy(checkpointed, tmp_path)
    before = snapshot(run)
    other = _build_with_one_shard_changed(data_root, tmp_path / "other")
    swapped = tmp_path / "swapped"
    shutil.copytree(data_root, swapped)
    shutil.copyfile(other / "styledigits" / "mono.h5", swapped / "styledigits" / "mono.h5")
    refusal = (f"shard {swapped / 'styledigits' / 'mono.h5'} (domain mono): it is not the shard this manifest was "
               "prepared with (content sha256 ")
    job = run_here("--resume", str(run), "--rounds", "3", "--data-root", str(swapped))
    assert job.returncode == 2
    one_error(job, refusal, "another build's file copied over it; delete")
    assert snapshot(run) == before
    job = run_here(*_args(swapped, tmp_path / "new", "--rounds", "1"))
    assert job.returncode == 2 and not (tmp_path / "new").exists()
    one_error(job, refusal)


def test_a_resume_on_another_thread_count_says_so_in_one_line(checkpointed, tmp_path):
    run = _copy(checkpointed, tmp_path)
    job = run_here("--resume", str(run), "--rounds", "3", "--threads", "2")
    assert job.returncode == 0, job.stderr
    warning = ("mpifl: warning: the client ranks run 2 torch threads, the run so far ran 1: CPU kernels may round "
               "otherwise, so the numbers may differ slightly from those of an uninterrupted run; resume with "
               "--threads 1 to repeat it bit for bit")
    assert job.lines("mpifl: ") == [warning] and (run / "log.txt").read_text().count(warning) == 1
    again = run_here("--resume", str(run), "--rounds", "4", "--threads", "2")  # the checkpoint says 2 now
    assert again.returncode == 0 and not again.lines("mpifl: "), again.stderr


def test_a_record_cut_off_by_a_kill_is_redone_and_a_changed_one_is_refused(checkpointed, tmp_path):
    run = _copy(checkpointed, tmp_path)
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"round": 3, "clients": [0, 2')  # killed while writing round 3's
    job = run_here("--resume", str(run), "--rounds", "3")
    assert job.returncode == 0 and "Traceback" not in job.stderr, job.stderr
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3] and not list(run.glob("traceback-*"))
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "not a record", *lines[1:]]) + "\n")
    before = snapshot(run)
    job = run_here("--resume", str(run), "--rounds", "4")
    assert job.returncode == 2
    one_error(job, f"{metrics}, line 2, is no round record ('not a record'): the file was changed after the run "
                   "wrote it; restore it from a copy")
    assert snapshot(run) == before


def test_a_checkpoint_from_before_data_and_threads_were_recorded_still_loads(tmp_path):
    """Format 4 stays: meta.json gained two optional records, which a resume checks when they are there."""
    (tmp_path / "checkpoint").mkdir()
    commit(tmp_path, Checkpoint(round=2, clients=5, ranks={1: [0]}, pending=None, identity=identity(_cfg()), files={},
                                data={"image_size": [28, 28], "shards": {"mono": "a" * 64}}, threads=[1]))
    build = {"image_size": [28, 28], "shards": {"mono": "b" * 64}}
    with pytest.raises(MpiflError, match=r"another build of styledigits .*\(other shards of mono \(sha256\)\)"):
        load(tmp_path, _cfg(), 5, build)
    meta = tmp_path / "checkpoint" / "meta.json"
    raw = json.loads(meta.read_text())
    del raw["data"], raw["threads"]  # as an earlier mpifl wrote it
    meta.write_text(json.dumps(raw))
    old = load(tmp_path, _cfg(), 5, build)
    assert (old.round, old.data, old.threads) == (2, None, None)


@pytest.mark.slow
def test_a_disk_full_at_a_checkpoint_ends_the_run_in_one_line_keeping_the_last_one(data_root, tmp_path, monkeypatch):
    """The file system fills while round 2's server.pt is written (reported at the flush, as on a network file
    system): one line, exit 2, no temporary file; the checkpoint after round 1 resumes."""
    run = tmp_path / "run"
    fsync = os.fsync

    def full_at_round_2(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("round-2/server.pt.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full_at_round_2)
    job = run_here(*_args(data_root, run, "--rounds", "3", "--ckpt-every", "1"))
    assert job.returncode == 2
    one_error(job, f"mpifl: error: cannot write {run}/checkpoint/round-2/server.pt: No space left on device; free "
                   f"space on its file system (or copy {run} to a file system that can hold it, and resume the copy); "
                   f"the checkpoint after round 1 is kept: continue with --resume {run}")
    assert sorted(p.relative_to(run).as_posix() for p in (run / "checkpoint").rglob("*") if p.is_file()) == \
        ["checkpoint/meta.json", "checkpoint/round-1/rank-1.zip", "checkpoint/round-1/server.pt"]
    monkeypatch.setattr(os, "fsync", fsync)
    job = run_here("--resume", str(run))
    assert job.returncode == 0, job.stderr
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3]


class _RunsCode:
    def __reduce__(self):
        return (exec, ("open('RAN', 'w').write('code ran')",))


@pytest.mark.slow
def test_a_server_file_that_would_run_code_is_refused_unread_before_anything_is_written(checkpointed, tmp_path,
                                                                                         monkeypatch):
    """Its record in meta.json made to match, as someone who swapped it would: a check of the file's content, not
    of its sha256, and before the resumed run writes its log or config.json."""
    run = _copy(checkpointed, tmp_path)
    server = run / "checkpoint" / "round-2" / "server.pt"
    torch.save({"model": {}, "extra": {}, "x": _RunsCode()}, server)
    meta = json.loads((run / "checkpoint" / "meta.json").read_text())
    meta["files"]["server.pt"] = {"bytes": server.stat().st_size, "sha256": sha256_file(server)}
    (run / "checkpoint" / "meta.json").write_text(json.dumps(meta))
    before = snapshot(run)
    monkeypatch.chdir(tmp_path)
    job = run_here("--resume", str(run), "--rounds", "3")
    assert job.returncode == 2
    one_error(job, f"mpifl: error: cannot load checkpoint file {server} (it holds Python objects besides tensors, "
                   "left unread: loading them could run code); it cannot be resumed")
    assert "weights_only" not in job.stdout + job.stderr and "Warning" not in job.stderr
    assert snapshot(run) == before and not (tmp_path / "RAN").exists()
