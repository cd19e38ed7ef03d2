"""Buffers above the count limit as MPI datatypes, in this process (the collectives over several ranks:
test_mpi.py)."""

import numpy as np
from mpi4py import MPI

from mpifl.transport.large import gatherv, typed


def test_a_buffer_above_the_count_limit_is_one_struct_of_all_its_bytes():
    buf = np.zeros(10_007, np.uint8)
    with typed(buf, 10_007) as (_, count, dtype):
        assert (count, dtype) == (10_007, MPI.BYTE)
    with typed(buf, 1000) as (_, count, dtype):  # 625 blocks of 16 bytes, then 7
        assert (count, dtype.Get_size(), dtype.Get_extent()) == (1, 10_007, (0, 10_007))


def test_a_gather_above_the_count_limit_pads_each_segment_to_a_common_block():
    sent, sizes = np.arange(13, dtype=np.uint8), []

    def receive_buffer(padded):
        sizes.append(padded)
        return np.zeros(sum(padded), np.uint8), np.zeros(1, np.int64)

    got = gatherv(MPI.COMM_SELF, sent, [13], 7, receive_buffer)  # 7 blocks of 2 bytes
    assert sizes == [[14]] and np.array_equal(got[0], sent)
