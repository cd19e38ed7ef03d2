"""The private store: state created on first training, spilled beyond the budget and read back bit for bit,
adopted entries as if written into every client every round, checkpoints streamed one client at a time."""

import os
import socket
import time

import numpy as np
import pytest
import torch

from mpifl.algorithms import Algorithm, ClientState
from mpifl.client.private_store import PrivateStore, state_bytes
from mpifl.dirlock import LOCK_NAME, try_lock
from mpifl.errors import MpiflError
from mpifl.plan.clients import ClientSpec

INITIAL = {"w": torch.zeros(4), "bn": torch.ones(2)}


class Keeper(Algorithm):
    """Keeps ``w`` and a control variate; ``bn`` is adopted (sent down, not back), as FixBN's second stage."""

    def __init__(self):  # no model or config: only what the store reads
        pass

    private_keys = ["w"]
    adopted_keys = ["bn"]

    def init_client(self, spec, initial):
        return ClientState(spec=spec, private={"w": initial["w"].clone(), "bn": initial["bn"].clone(),
                                               "c": torch.zeros(4)})


def _store(budget_gib, n=4, tmp=None, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("TMPDIR", str(tmp))
    specs = {i: ClientSpec(id=i, domain="d", rows={"train": np.arange(2)}) for i in range(n)}
    return PrivateStore(Keeper(), specs, INITIAL, torch.device("cpu"), budget_gib, rank=1)


def _train(store, cid, value):
    client = store.get(cid)
    client.private["w"] += value
    client.private["c"] -= value
    store.fit_budget()


def test_state_exists_only_for_clients_that_trained(tmp_path, monkeypatch):
    store = _store(1.0, tmp=tmp_path, monkeypatch=monkeypatch)
    assert not store.resident and not store.spilled
    looked = store.peek(2)  # a personal evaluation of a client that never trained: the initial state, dropped
    assert torch.equal(looked.private["w"], INITIAL["w"]) and not store.resident
    _train(store, 1, 1.5)
    assert list(store.resident) == [1] and torch.equal(store.peek(1).private["w"], torch.full((4,), 1.5))


def test_a_zero_budget_keeps_only_the_client_in_use_and_reads_the_rest_back_bit_for_bit(tmp_path, monkeypatch):
    store = _store(0.0, tmp=tmp_path, monkeypatch=monkeypatch)
    values = {0: torch.randn(4), 1: torch.randn(4), 3: torch.randn(4)}
    for cid, value in values.items():
        _train(store, cid, value)
        assert list(store.resident) == [cid]
    folder, = tmp_path.iterdir()
    assert folder.name.startswith(f"mpifl-private-{socket.gethostname()}-rank1-")
    assert sorted(p.name for p in folder.iterdir()) == [".mpifl-lock", "client-0.pt", "client-1.pt"]  # held
    for cid, value in values.items():
        assert torch.equal(store.get(cid).private["w"], value) and torch.equal(store.get(cid).private["c"], -value)
    store.close()
    assert not folder.exists()


def test_the_budget_spills_the_least_recently_used_first(tmp_path, monkeypatch):
    one = state_bytes(Keeper().init_client(None, INITIAL).private)
    store = _store(2.5 * one / 2**30, tmp=tmp_path, monkeypatch=monkeypatch)
    for cid in (0, 1, 2):
        _train(store, cid, 1.0)
    assert list(store.resident) == [1, 2] and store.spilled == {0}
    _train(store, 1, 1.0)  # 1 is now the most recent: 2 goes next
    _train(store, 3, 1.0)
    assert list(store.resident) == [1, 3] and store.spilled == {0, 2}


@pytest.mark.parametrize("budget", [0.0, 1.0])
def test_adopted_entries_reach_a_client_as_if_written_into_every_client_every_round(budget, tmp_path, monkeypatch):
    store = _store(budget, tmp=tmp_path, monkeypatch=monkeypatch)
    store.adopt({"bn": torch.tensor([2.0, 2.0])}, 1)
    _train(store, 0, 1.0)
    store.get(0).private["bn"] += 10  # its training moves its copy after round 1's adoption
    store.fit_budget()
    _train(store, 1, 1.0)
    store.adopt({"bn": torch.tensor([3.0, 3.0])}, 2)
    _train(store, 1, 1.0)
    store.algo.adopted_keys = []  # a stage in which bn is no longer sent down: each keeps its last copy
    assert store.get(0).private["bn"].tolist() == [3.0, 3.0]  # missed round 2's while out of use: gets it now
    store.get(1).private["bn"] += 1  # trained after round 2's adoption: its own value stays
    store.fit_budget()
    assert store.get(1).private["bn"].tolist() == [4.0, 4.0]
    assert store.peek(3).private["bn"].tolist() == [3.0, 3.0]  # never trained: the initial state + the latest copy


def test_saved_states_are_up_to_date_one_at_a_time_and_a_restored_store_continues_identically(tmp_path,
                                                                                             monkeypatch):
    store = _store(0.0, tmp=tmp_path, monkeypatch=monkeypatch)
    for cid in (0, 2):
        _train(store, cid, float(cid + 1))
    store.adopt({"bn": torch.tensor([5.0, 6.0])}, 4)
    saved = list(store.saved_states())
    assert [cid for cid, _ in saved] == [0, 2]
    assert all(state["bn"].tolist() == [5.0, 6.0] and state["w"].device.type == "cpu" for _, state in saved)
    assert store.get(0).private["bn"].tolist() == [5.0, 6.0]  # its spilled file was left stale, and is synced
    restored = _store(0.0)
    restored.restore(iter(saved), store.adopted_record())
    assert set(restored.resident) | restored.spilled == {0, 2} and len(restored.resident) == 1
    for cid in (0, 2):
        assert all(torch.equal(restored.get(cid).private[k], store.get(cid).private[k]) for k in ("w", "bn", "c"))
    assert restored.peek(1).private["bn"].tolist() == [5.0, 6.0]
    restored.close()


def test_a_saved_state_of_another_shape_is_refused_in_one_line():
    store = _store(1.0)
    with pytest.raises(MpiflError, match=r"state of client 1 lacks c \(4,\); the checkpoint is of another model"):
        store.restore(iter([(1, {"w": torch.zeros(4), "bn": torch.ones(2), "c": torch.zeros(5)})]), {})


def test_an_unusable_spill_folder_is_one_line_at_set_up_or_when_it_goes_away_later(tmp_path, monkeypatch):
    with pytest.raises(MpiflError, match=r"--private-memory 0 GiB: client rank 1's 4 clients' private state can "
                                         r"outgrow it and would spill to TMPDIR=.*absent, which does not exist"):
        _store(0.0, tmp=tmp_path / "absent", monkeypatch=monkeypatch)
    (tmp_path / "gone").mkdir()
    store = _store(0.0, tmp=tmp_path / "gone", monkeypatch=monkeypatch)
    (tmp_path / "gone").rmdir()  # removed while the run lives
    _train(store, 0, 1.0)
    with pytest.raises(MpiflError, match="cannot create a folder for private state beyond the budget.*TMPDIR"):
        _train(store, 1, 1.0)


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_spill_file_damaged_while_the_run_lives_names_the_client_the_file_and_the_recovery(tmp_path, monkeypatch,
                                                                                             damage):
    store = _store(0.0, tmp=tmp_path, monkeypatch=monkeypatch)
    _train(store, 0, 1.0)
    _train(store, 1, 2.0)  # client 0 spilled
    path, = (p for p in tmp_path.rglob("client-0.pt"))
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:20])
    else:
        path.unlink()
    with pytest.raises(MpiflError) as e:
        store.get(0)
    message = str(e.value)
    problem = "cannot be read back" if damage == "truncated" else "is gone"
    assert f"client 0's private state, spilled to {path}, {problem}" in message
    assert "--resume RUN_DIR" in message and "\n" not in message


def test_spill_folders_whose_rank_is_gone_are_removed_by_the_next_run_that_spills_on_their_node(tmp_path,
                                                                                                monkeypatch):
    here = f"mpifl-private-{socket.gethostname()}"
    killed = tmp_path / f"{here}-rank1-killed"  # a rank killed outright: its lock file holds nothing now
    killed.mkdir()
    (killed / LOCK_NAME).write_text("pid 1 on a node, since then")
    (killed / "client-3.pt").write_bytes(b"state")
    live = tmp_path / f"{here}-rank2-live"  # another run's rank at work
    live.mkdir()
    holder = try_lock(live)
    unclaimed = tmp_path / f"{here}-rank3-new"  # just made, its rank about to claim it
    unclaimed.mkdir()
    old = tmp_path / f"{here}-rank4-old"  # made long ago and never claimed
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    mine = tmp_path / "not-mpifl"
    mine.mkdir()
    # another node's, in a TMPDIR the nodes share: its lock may be that node's alone, so it is never swept here
    elsewhere = tmp_path / f"mpifl-private-{socket.gethostname()}x-rank1-killed"
    elsewhere.mkdir()
    (elsewhere / LOCK_NAME).write_text("pid 1 on another node")
    os.utime(elsewhere, (time.time() - 3600, time.time() - 3600))
    store = _store(0.0, tmp=tmp_path, monkeypatch=monkeypatch)
    _train(store, 0, 1.0)
    _train(store, 1, 1.0)  # the first spill
    assert not killed.exists() and not old.exists()
    assert live.exists() and unclaimed.exists() and mine.exists() and elsewhere.exists()
    holder.release()
    store.close()
