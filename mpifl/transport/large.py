"""Buffers above MPI's count limit.  MPI counts are C ints, so a buffer above ``max_count`` bytes travels as a
derived datatype (BigMPI's construction), still in one call: a broadcast or a message as one struct of whole
blocks plus the remainder, a gather with each rank's segment padded to a common block."""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from .wire import Buffer

INT_MAX = 2**31 - 1


@contextlib.contextmanager
def typed(buf: Buffer, max_count: int):
    """``buf`` as an MPI message: bytes, or above ``max_count`` one struct (freed on leaving)."""
    n = buf.nbytes
    if n <= max_count:
        yield [buf, n, MPI.BYTE]
        return
    dtype = _struct_type(n, max_count)
    try:
        yield [buf, 1, dtype]
    finally:
        dtype.Free()


def gatherv(comm: MPI.Comm, sendbuf: Buffer, counts: list[int], max_count: int,
            receive_buffer: Callable[[list[int]], tuple[Buffer, np.ndarray]]) -> list[Buffer] | None:
    """Gather rank r's ``counts[r]`` bytes at rank 0, into ``receive_buffer(padded sizes)`` (the buffer and the
    segments' offsets); on rank 0 a view of each rank's segment, None elsewhere."""
    block = _smallest_block(lambda b: sum(-(-c // b) for c in counts), max_count)
    padded = [-(-c // block) * block for c in counts]
    if block > 1 and sendbuf.nbytes != padded[comm.rank]:
        staged = sendbuf.new_zeros(padded[comm.rank]) if isinstance(sendbuf, torch.Tensor) \
            else np.zeros(padded[comm.rank], dtype=np.uint8)
        staged[:sendbuf.nbytes] = sendbuf
        sendbuf = staged
    recv, displs = receive_buffer(padded) if comm.rank == 0 else (None, None)
    dtype = MPI.BYTE if block == 1 else MPI.BYTE.Create_contiguous(block).Commit()
    try:
        comm.Gatherv(
            [sendbuf, len(sendbuf) // block, dtype],
            [recv, ([p // block for p in padded], [int(d) // block for d in displs]), dtype]
            if comm.rank == 0 else None,
            root=0)
    finally:
        if block > 1:
            dtype.Free()
    if comm.rank != 0:
        return None
    return [recv[d:d + c] for d, c in zip(displs, counts)]


def _struct_type(n: int, max_count: int) -> MPI.Datatype:
    """``n`` bytes as one committed struct: whole blocks, then the remainder."""
    block = _smallest_block(lambda b: n // b, max_count)
    whole, rest = divmod(n, block)
    chunk = MPI.BYTE.Create_contiguous(block)
    parts, counts, displs = [chunk], [whole], [0]
    if rest:
        parts.append(MPI.BYTE.Create_contiguous(rest))
        counts.append(1)
        displs.append(whole * block)
    dtype = MPI.Datatype.Create_struct(counts, displs, parts).Commit()
    for part in parts:
        part.Free()
    return dtype


def _smallest_block(count: Callable[[int], int], max_count: int) -> int:
    """The smallest power of two ``block`` for which ``count(block)`` is at most ``max_count``."""
    block = 1
    while count(block) > max_count:
        block *= 2
    return block
