"""The fold's kernel, and the main of a helper process that runs it for rank 0 (:mod:`.fold_workers`).

:func:`fold_run` adds sum_k c_k x_k into float64 sums over element ranges, block by block, every term of a block
in order before the next block: each element's sum is one chain of additions in the terms' order, whoever runs
its range.  A helper process runs this file by path (:data:`.fold_workers.HELPER`), so it imports only numpy
and the standard library, not torch or the methods.  It serves one request at a time on the Unix socket ``FD``: maps
the shared-memory segments whose file descriptors came with it, folds its run, replies; it ends when the
socket closes: rank 0 closed it, or ended.

A message is 8 bytes of length, then that many bytes of JSON (a float's JSON text is its exact value); file
descriptors ride on its first bytes.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import sys

import numpy as np

SUM_BLOCK = 1 << 14  # elements per block: the float64 partial sum and one term stay in the L1/L2 cache
MAX_FDS = 253  # file descriptors one message may carry (Linux's SCM_MAX_FD)


def fold_run(sums, run, zero: bool = False, size: int = SUM_BLOCK) -> None:
    """Add sum_k c_k x_k to each flat float64 ``acc`` of ``sums`` [(acc, [(c_k, flat x_k), ...])] over the element
    ranges of ``run`` [(index into sums, start, stop)]; with ``zero``, to zero (each block zeroed as it is
    reached, while in the cache), not to what ``acc`` held.  A term is x_k made float64, then times c_k (what
    float64(x_k) * c_k gives, a little faster than one cast multiply)."""
    scratch = np.empty(min(size, max((stop - start for _, start, stop in run), default=0)), dtype=np.float64)
    for index, start, stop in run:
        acc, terms = sums[index]
        for low in range(start, stop, size):
            high = min(low + size, stop)
            block, term = acc[low:high], scratch[:high - low]
            if zero:
                block.fill(0.0)
            for c, x in terms:
                np.copyto(term, x[low:high])
                term *= c
                block += term


def send(sock: socket.socket, data: bytes, fds=()) -> None:
    """Send the message ``data`` (JSON text), with ``fds``."""
    packet = memoryview(len(data).to_bytes(8, "little") + data)
    sent = socket.send_fds(sock, [packet], list(fds)) if fds else 0
    sock.sendall(packet[sent:])


def receive(sock: socket.socket):
    """The next message and the file descriptors that came with it; None once the other end has closed.  One
    message is in flight at a time (a request, then its reply), so a read never takes the next one's bytes."""
    data, fds, flags, _ = socket.recv_fds(sock, 1 << 16, MAX_FDS)
    if flags & socket.MSG_CTRUNC:
        raise OSError("a message's file descriptors were cut off")
    data = bytearray(data)
    while data and len(data) < (8 + int.from_bytes(data[:8], "little") if len(data) >= 8 else 8):
        more = sock.recv(1 << 20)
        if not more:  # the other end closed within a message
            data.clear()
        data += more
    if not data:
        for handle in fds:
            os.close(handle)
        return None
    return json.loads(data[8:]), fds


def view(maps: dict, described) -> np.ndarray:
    """The flat array that ``described`` [segment, byte offset, dtype, elements] names in the mapped segments."""
    segment, offset, dtype, count = described
    if not count:
        return np.empty(0, dtype=dtype)
    return np.frombuffer(maps[segment], dtype=dtype, count=count, offset=offset)


def serve(fd: int) -> None:
    """Answer rank 0's requests on socket ``fd`` until it closes (the request's keys: :meth:`.fold_workers._Helper
    .request`)."""
    sock, maps = socket.socket(fileno=fd), {}
    while (received := receive(sock)) is not None:
        request, fds = received
        try:
            for (segment, nbytes), handle in zip(request["new"], fds):
                maps[segment] = mmap.mmap(handle, nbytes)
            for segment in request["gone"]:
                maps.pop(segment)
            sums = [(view(maps, acc), [(c, view(maps, x)) for c, x in terms]) for acc, terms in request["sums"]]
            fold_run(sums, request["run"], request["zero"])
            del sums  # no view of a segment outlives the request: a gone segment's map can close
            reply = {}
        except Exception as exc:  # to rank 0, which ends the run with it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for handle in fds:
                os.close(handle)
        send(sock, json.dumps(reply).encode())


if __name__ == "__main__":
    serve(int(sys.argv[-1]))
