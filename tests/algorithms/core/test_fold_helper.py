import json
import os
import socket
import threading

import numpy as np

from mpifl.algorithms.core.fold_helper import fold_run, receive, send


def test_a_message_larger_than_one_read_arrives_whole_with_its_file_descriptors_then_the_end():
    ours, theirs = socket.socketpair()
    message = {"sums": [[i, 0.1 * i, "<f4"] for i in range(100_000)], "zero": True}  # about 3 MB of JSON
    read, write = os.pipe()
    sender = threading.Thread(target=lambda: (send(theirs, json.dumps(message).encode(), [read]), theirs.close()))
    sender.start()
    received, fds = receive(ours)
    sender.join()
    assert received == message and len(fds) == 1
    os.write(write, b"x")
    assert os.read(fds[0], 1) == b"x"  # the same pipe, through another descriptor
    for fd in (read, write, *fds):
        os.close(fd)
    assert receive(ours) is None


def test_a_run_with_zero_overwrites_what_its_blocks_held_and_leaves_the_rest():
    size = 5
    acc = np.full(3 * size, 7.0)
    x = np.arange(3 * size, dtype=np.float32)
    fold_run([(acc, [(2.0, x)])], [(0, size, 3 * size)], zero=True, size=size)
    np.testing.assert_array_equal(acc[:size], 7.0)
    np.testing.assert_array_equal(acc[size:], 2.0 * x[size:])
    fold_run([(acc, [(1.0, x)])], [(0, 0, size)], size=size)
    np.testing.assert_array_equal(acc[:size], 7.0 + x[:size])
