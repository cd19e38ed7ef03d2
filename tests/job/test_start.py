"""What a rank does before its role: the threads rank 0 computes on in one process."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_in_one_process_rank_0_computes_on_one_torch_thread_before_any_set_up():
    """Its idle OpenMP team would slow every parallel operation of the client thread
    (:mod:`mpifl.transport.inprocess`)."""
    script = textwrap.dedent("""
        import sys, torch
        torch.set_num_threads(2)
        import mpifl.job.start as start
        def configure(*args):
            print("threads", torch.get_num_threads())
            sys.exit(0)
        start.configure = configure
        start.start(lambda: None, False, None)
    """)
    job = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    assert job.stdout.split() == ["threads", "1"]
