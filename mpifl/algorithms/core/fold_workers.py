"""Rank 0's fold on several cores: its own thread and helper processes over shared memory, bit for bit.

A fold (:mod:`.reduction`) cuts its sums into runs of consecutive blocks (:func:`ranges`); the calling thread folds
the first run and each helper process another, every run with :func:`~.fold_helper.fold_run`, so each element's
sum is the same chain of additions in client-id order whoever folds it.  Processes, not threads: two threads of
one process meet at every numpy call (a GIL hand-over, or an OpenMP barrier inside torch) and on the 2-core
development VM stopped at 0.72-0.74x one thread's time, two processes never meet (0.46-0.58x, the rest the memory
the two cores share; docs/benchmarks.md, "Rank 0's fold on several cores").

The arrays a fold reads and writes are shared with the helpers: the server allocates the uploads' receive buffer
and the sums with :meth:`FoldWorkers.empty` and :meth:`FoldWorkers.sums`, in segments of shared memory (Linux
``memfd_create``, mapped by rank 0 and each helper).  A segment's file descriptor travels to a helper with the
first request that reads it; a helper unmaps a segment that rank 0 has dropped with its next request.  A fold
of an array not allocated so runs whole in the calling thread, as does every fold with one worker or where the
platform has no ``memfd_create``.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import numpy as np

from ...errors import MpiflError
from ...process.signals import STOP_SIGNALS
from . import fold_helper
from .fold_helper import SUM_BLOCK, fold_run

#: the helper's command line: it ignores the stop signals first (rank 0 handles them; a launcher or Slurm may
#: signal every process), then runs fold_helper.py; ``python -c``, so that its first path entry is the working
#: directory, as for ``python -m`` (run by path, the folder of fold_helper.py, whose siblings are no top-level
#: modules, would come first)
HELPER = [sys.executable, "-c", "import runpy, signal, sys\n"
          f"for stop in {[int(stop) for stop in STOP_SIGNALS]}:\n    signal.signal(stop, signal.SIG_IGN)\n"
          "runpy.run_path(sys.argv[1], run_name='__main__')", fold_helper.__file__]
SHARED = hasattr(os, "memfd_create")
KEPT = 2  # blocks of sums kept for reuse: the last round's sums are still held while the next round's fold starts


class _Mapping(mmap.mmap):
    """A segment mapped in rank 0; ``segment`` is its id.  (A subclass: it takes attributes, and a weak reference
    tells when the last array on it is gone.)"""

    segment: int


class _Segments:
    """The live shared-memory segments, by id: their start address, size and file descriptor.  A mapping's
    finalizer only notes its segment as dropped (it may run inside any call, at a garbage collection); every
    method takes the dropped ones out first, under the lock, before an address can be looked up: a dropped
    segment's address may hold new memory by then."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = 0
        self._live: dict[int, tuple[int, int, int]] = {}  # id: (address, nbytes, fd)
        self._starts: list[tuple[int, int]] = []  # (address, id), ascending
        self._dropped: list[int] = []  # ids whose mapping is gone (appended by finalizers)

    def _tidy(self) -> None:
        """Take the dropped segments out and close their file descriptors (under the lock)."""
        while self._dropped:
            segment = self._dropped.pop()
            address, _, fd = self._live.pop(segment)
            self._starts.remove((address, segment))
            os.close(fd)

    def map(self, nbytes: int) -> _Mapping:
        """A new segment of ``nbytes`` zero bytes (at least one), live while its mapping is."""
        nbytes = max(nbytes, 1)
        fd = os.memfd_create("mpifl-fold", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mapping = _Mapping(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        address = np.frombuffer(mapping, dtype=np.uint8).__array_interface__["data"][0]
        with self._lock:
            self._tidy()
            mapping.segment, self._next = self._next, self._next + 1
            self._live[mapping.segment] = (address, nbytes, fd)
            bisect.insort(self._starts, (address, mapping.segment))
        weakref.finalize(mapping, self._dropped.append, mapping.segment)  # before the unmap
        return mapping

    def live(self) -> dict[int, tuple[int, int, int]]:
        """The live segments: {id: (address, nbytes, fd)}."""
        with self._lock:
            self._tidy()
            return dict(self._live)

    def describe(self, arrays: Sequence[np.ndarray]) -> list[list] | None:
        """[segment, byte offset, dtype, elements] of each of ``arrays``, contiguous and inside live segments (an
        empty one: segment None); None if one is not."""
        described = []
        with self._lock:
            self._tidy()
            for array in arrays:
                if not array.size:
                    described.append([None, 0, array.dtype.str, 0])
                    continue
                if not array.flags.c_contiguous:
                    return None
                address = array.ctypes.data
                at = bisect.bisect_right(self._starts, (address, float("inf"))) - 1
                if at < 0:
                    return None
                start, segment = self._starts[at]
                if address + array.nbytes > start + self._live[segment][1]:
                    return None
                described.append([segment, address - start, array.dtype.str, array.size])
        return described


SEGMENTS = _Segments()


def ranges(sizes: Sequence[int], parts: int, block: int = SUM_BLOCK) -> list[list[tuple[int, int, int]]]:
    """The elements of arrays of ``sizes``, laid end to end in blocks of ``block`` elements (an array's last
    block shorter), cut into at most ``parts`` runs of consecutive blocks, as near equal in blocks as can be:
    each run as its (array, start, stop) element ranges, every start at a block boundary of its array."""
    blocks = [-(-n // block) for n in sizes]
    total = sum(blocks)
    parts = max(1, min(parts, total))
    cuts = [total * i // parts for i in range(parts + 1)]
    runs = []
    for low, high in zip(cuts, cuts[1:]):
        run, first = [], 0
        for index, count in enumerate(blocks):
            start, stop = max(low, first), min(high, first + count)
            if start < stop:
                run.append((index, (start - first) * block, min(sizes[index], (stop - first) * block)))
            first += count
        runs.append(run)
    return runs


class _Helper:
    """One helper process and rank 0's end of its socket."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with theirs:
            self.process = subprocess.Popen(HELPER + [str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                            stdin=subprocess.DEVNULL, env=env)
        self.socket = ours
        self.mapped: set[int] = set()  # the segments it has mapped
        self.asked = 0.0  # when it was last asked to fold (time.monotonic())

    def request(self, sums: str, run: list, segments: set[int], zero: bool) -> None:
        """Ask it to fold ``run`` of ``sums`` (described, :meth:`_Segments.describe`, in JSON; ``zero``: from
        zero), which read ``segments``: those it has not mapped travel with the request, those dropped since go."""
        live = SEGMENTS.live()
        new = sorted(segments - self.mapped)
        gone = sorted(self.mapped - set(live))
        self.mapped = (self.mapped - set(gone)) | set(new)
        head = json.dumps({"new": [[s, live[s][1]] for s in new], "gone": gone, "run": run, "zero": zero})
        self.asked = time.monotonic()
        try:
            fold_helper.send(self.socket, f'{head[:-1]}, "sums": {sums}}}'.encode(), [live[s][2] for s in new])
        except OSError:  # it has gone: reply() says how
            pass

    def reply(self, deadline: float | None = None) -> str | None:
        """Wait for the fold asked for, until ``deadline`` (``time.monotonic()``; None: for ever); what went wrong,
        if anything did.  A helper that has not answered by then (stopped, or hung) is killed."""
        self.socket.settimeout(None if deadline is None else max(1e-3, deadline - time.monotonic()))  # 0: no wait
        try:
            received = fold_helper.receive(self.socket)
        except TimeoutError:
            self.process.kill()  # a stopped process too
            self.process.wait()
            return (f"rank 0's fold helper process (pid {self.process.pid}) did not answer for "
                    f"{time.monotonic() - self.asked:.0f} s (--round-timeout): it was stopped or hung; fold without "
                    "helpers (--fold-threads 1)")
        except OSError:
            received = None
        finally:
            self.socket.settimeout(None)
        if received is not None:
            return received[0].get("error")
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # alive, but its socket broke
            self.process.kill()
            code = self.process.wait()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return (f"rank 0's fold helper process (pid {self.process.pid}) stopped answering: it {how}; if the node ran "
                "out of memory, give rank 0 more or fold without helpers (--fold-threads 1)")

    def close(self) -> None:
        self.socket.close()  # the helper ends at its next read
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class FoldWorkers:
    """``count`` workers that share every fold by element ranges: the thread that folds and ``helpers`` helper
    processes, ``count - 1`` (none where the platform has no ``memfd_create``), which run while the workers are
    entered (``with``); a fold waits ``timeout`` seconds at most for its helpers (else it fails, naming the helper
    that did not answer).  With ``behind``, :class:`~.reduction.Behind` folds on one more thread of rank 0 while its
    caller receives (rank 0 has a core that no client rank trains on); without, in the caller's thread as uploads
    are handed over.  Made once (by the server) and reused every round."""

    def __init__(self, count: int = 1, behind: bool = True, timeout: float | None = None):
        if count < 1:
            raise ValueError(f"{count} fold workers")
        self.count, self.behind = count, behind
        self.timeout = timeout  # seconds a fold waits for its helpers (rank 0's --round-timeout); None: for ever
        self.helpers = count - 1 if SHARED else 0
        self._helpers: list[_Helper] = []  # while entered
        self._lock = threading.Lock()  # one fold at a time on the helpers
        self._kept: list[_Mapping] = []  # the last blocks of sums (:meth:`sums`)
        self._background: ThreadPoolExecutor | None = None

    @property
    def pids(self) -> list[int]:
        """The helper processes' ids."""
        return [helper.process.pid for helper in self._helpers]

    def empty(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes (uint8) that a fold can share with the helpers."""
        if not self._helpers:
            return np.empty(nbytes, dtype=np.uint8)
        return np.frombuffer(SEGMENTS.map(nbytes), dtype=np.uint8, count=nbytes)

    def sums(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """Float64 arrays of each of ``shapes`` for a fold's sums, in one block of memory that the helpers share;
        their values are whatever the memory held, so the first fold into them zeroes them (``zero``).  With
        helpers, the block is one of the last :data:`KEPT` blocks where no array on it is left: fresh shared
        memory is zeroed page by page as the fold first writes it, which took the 2-core development VM a third
        of the fold's time on two cores (0.113 against 0.075 s for 12 x 45 MB)."""
        sizes = [int(np.prod(shape)) for shape in shapes.values()]
        if self._helpers:
            block = np.frombuffer(self._block(8 * sum(sizes)), dtype=np.float64, count=sum(sizes))
        else:
            block = np.empty(sum(sizes), dtype=np.float64)
        offsets = np.cumsum([0] + sizes)
        return {name: block[offsets[i]:offsets[i + 1]].reshape(shape) for i, (name, shape) in enumerate(shapes.items())}

    def _block(self, nbytes: int) -> _Mapping:
        """A kept segment of ``nbytes`` or more that nothing but this list holds (its count of references: the
        list's, the loop's and the call's), else a new one, kept in place of the oldest."""
        for mapping in self._kept:
            if len(mapping) >= nbytes and sys.getrefcount(mapping) == 3:
                self._kept.remove(mapping)
                break
        else:
            mapping = SEGMENTS.map(nbytes)
        self._kept = self._kept[-(KEPT - 1):] + [mapping]
        return mapping

    def fold(self, sums: Sequence[tuple[np.ndarray, list[tuple[float, np.ndarray]]]], zero: bool = False) -> None:
        """Add sum_k c_k x_k to each flat float64 ``acc`` of ``sums`` [(acc, [(c_k, flat x_k), ...])] (with
        ``zero``, set each to it): the first run of blocks here, the others on the helpers (all of it here where
        a request cannot name the arrays: :meth:`_request`)."""
        runs = ranges([acc.size for acc, _ in sums], 1 + len(self._helpers))
        request = self._request(sums) if len(runs) > 1 else None
        if request is None:
            fold_run(sums, [(index, 0, acc.size) for index, (acc, _) in enumerate(sums)], zero)
            return
        encoded, segments = request
        with self._lock:
            for helper, run in zip(self._helpers, runs[1:] + [[]] * (len(self._helpers) + 1 - len(runs))):
                helper.request(encoded, run, segments, zero)
            try:
                fold_run(sums, runs[0], zero)
            finally:  # the helpers read and write these arrays until they reply
                deadline = None if self.timeout is None else time.monotonic() + self.timeout
                failures = [failure for failure in (helper.reply(deadline) for helper in self._helpers) if failure]
            if failures:
                raise MpiflError(failures[0])

    @staticmethod
    def _request(sums) -> tuple[str, set[int]] | None:
        """``sums`` as a request names them (:meth:`_Segments.describe`), in JSON (encoded once: the same for every
        helper), and the segments they lie in; None if an array is not shared, or if they lie in more segments
        than one request can carry the file descriptors of."""
        arrays = [array for acc, terms in sums for array in [acc] + [x for _, x in terms]]
        parts = SEGMENTS.describe(arrays)
        if parts is None:
            return None
        segments = {segment for segment, *_ in parts if segment is not None}
        if len(segments) > fold_helper.MAX_FDS:
            return None
        described, at = [], 0
        for _, terms in sums:
            described.append([parts[at], [[float(c), x] for (c, _), x in zip(terms, parts[at + 1:])]])
            at += 1 + len(terms)
        return json.dumps(described), segments

    def background(self, job: Callable[[], None]) -> None:
        """Start ``job`` on the background thread (jobs run one after another, in the order started)."""
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="mpifl-fold-behind")
        self._background.submit(job)

    def __enter__(self) -> FoldWorkers:
        """Start the helpers."""
        try:
            while len(self._helpers) < self.helpers:
                self._helpers.append(_Helper())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        """End the background thread (after what it runs) and the helpers."""
        if self._background is not None:
            self._background.shutdown()
        for helper in self._helpers:
            helper.close()
        self._background, self._helpers, self._kept = None, [], []


SERIAL = FoldWorkers(1)
