"""The in-process transport: the collectives of the MPI one between threads, and turn-taking set-up."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from mpifl.errors import MpiflError
from mpifl.transport.inprocess import ThreadComm, Room, run_threads


def _world(size: int, body, timeout: float | None = None) -> dict:
    """Run ``body(comm)`` on ``size`` threads; {rank: result}."""
    room, out, errors = Room(size), {}, []

    def rank_main(rank):
        try:
            out[rank] = body(ThreadComm(room, rank, timeout))
        except BaseException as exc:  # surfaced in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("as_buffer", [np.asarray, torch.from_numpy])
def test_bcast_and_gatherv_move_the_bytes_as_mpi_does(as_buffer):
    n = 10_007
    expected = np.arange(n, dtype=np.uint64).astype(np.uint8)

    def body(comm):
        buf = as_buffer(expected.copy() if comm.rank == 0 else np.zeros(n, np.uint8))
        comm.bcast(buf)
        counts = [0] + [1000 * r + 3 for r in range(1, comm.size)]
        for _ in range(2):  # the receive buffer is reused
            got = comm.gatherv(as_buffer(np.full(counts[comm.rank], comm.rank, np.uint8)), counts)
        return np.asarray(buf).copy(), got and [np.asarray(g).copy() for g in got]

    out = _world(3, body)
    assert all(np.array_equal(out[r][0], expected) for r in range(3))
    assert [len(g) for g in out[0][1]] == [0, 1003, 2003] and all((g == r).all() for r, g in enumerate(out[0][1]))
    assert out[1][1] is None and out[2][1] is None


def test_messages_to_rank_0_arrive_in_each_senders_order_and_a_silent_sender_times_out():
    def body(comm):
        if comm.rank:
            comm.complete([comm.post(np.full(7, 10 * comm.rank + i, np.uint8)) for i in range(3)])
            return None
        order = [(r, i) for i in range(3) for r in (2, 1)]
        bufs = [np.zeros(7, np.uint8) for _ in order]
        comm.receive(bufs[:4], [r for r, _ in order[:4]])
        comm.receive(bufs[4:], [r for r, _ in order[4:]])
        with pytest.raises(MpiflError, match=r"waiting for a client's upload: rank 1 \(pid"):
            comm.receive([np.zeros(7, np.uint8)], [1])
        return [int(b[0]) for b in bufs]

    assert _world(3, body, timeout=0.3)[0] == [20, 10, 21, 11, 22, 12]


def test_posting_a_message_does_not_wait_for_rank_0_and_completing_it_does():
    posted = threading.Event()

    def body(comm):
        if comm.rank:
            handles = [comm.post(np.full(3, i, np.uint8)) for i in range(2)]
            posted.set()
            comm.complete(handles)
            return None
        assert posted.wait(10)  # rank 1 posted both while rank 0 received nothing
        bufs = [np.zeros(3, np.uint8) for _ in range(2)]
        comm.receive(bufs, [1, 1])
        return [int(b[0]) for b in bufs]

    assert _world(2, body, timeout=10)[0] == [0, 1]


def test_a_failed_world_releases_a_rank_blocked_on_a_message():
    def body(comm):
        if comm.rank == 1:
            time.sleep(0.2)
            comm.room.fail(3)
            return None
        with pytest.raises(SystemExit) as stopped:
            comm.receive([np.zeros(1, np.uint8)], [1])
        return stopped.value.code

    assert _world(2, body)[0] == 3


def test_objects_are_copies_in_rank_order():
    shared = {"a": [1]}

    def body(comm):
        got = comm.bcast_object(shared if comm.rank == 0 else None)
        return got, comm.allgather_object(comm.rank * 10), comm.gather_object(comm.rank)

    out = _world(3, body)
    assert out[1][0] == shared and out[1][0] is not shared  # as a pickled MPI object would be
    assert out[2][1] == [0, 10, 20] and out[0][2] == [0, 1, 2] and out[1][2] is None


def test_set_up_steps_take_turns_in_rank_order_every_time():
    order = []

    def body(comm):
        for step in range(2):
            if comm.rank == 0:
                time.sleep(0.05)  # rank 0 arrives last, still goes first
            with comm.in_turn():
                order.append((step, comm.rank))
            comm.arrive("the step")

    _world(3, body)
    assert order == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_a_rank_that_never_arrives_times_the_others_out_naming_it():
    def body(comm):
        if comm.rank == 2:
            return None
        with pytest.raises(MpiflError, match=r"timed out after 0\.2 s waiting for the uploads: rank 2 \(pid \d+ on .+, "
                                             r"thread mpifl-rank-2\) stopped answering"):
            comm.arrive("the uploads")
        return True

    result = _world(3, body, timeout=0.2)
    assert result[0] is True and result[1] is True


def test_run_threads_exits_with_the_first_failing_ranks_code():
    with pytest.raises(SystemExit) as exc:
        run_threads(3, lambda comm: (_ for _ in ()).throw(SystemExit(2 if comm.rank == 2 else 0)))
    assert exc.value.code == 2
    run_threads(2, lambda comm: comm.arrive("everyone"))  # all succeed: returns
