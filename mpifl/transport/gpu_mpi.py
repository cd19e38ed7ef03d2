"""Whether the MPI library moves GPU memory itself (CUDA-aware), and so where a GPU rank's messages live.

A CUDA-aware MPI reads and writes device pointers: the download can land
straight in GPU memory and the upload leave from it, with no host copy.
Any other MPI would read a device pointer as host memory and crash, so the
choice follows what the library says of itself.

Detection calls ``MPIX_Query_cuda_support()``, which Open MPI (>= 2.0) and
MPICH (>= 4.0) export: 1 when the library was built with CUDA and its
runtime has CUDA support on (MPICH: ``MPIR_CVAR_ENABLE_GPU``, on by default
in a GPU build).  The symbol is looked up in the MPI library mpi4py was
built against, after ``MPI_Init``.  Libraries without it (Cray MPICH,
MVAPICH2-GDR, Intel MPI) answer "unknown".

``--gpu-buffers``:

* ``auto``: GPU buffers when the library answers yes, else pinned host buffers;
* ``pinned``: always pinned host buffers (the portable choice);
* ``device``: GPU buffers, for a library that supports them but cannot say
  so (Cray MPICH with ``MPICH_GPU_SUPPORT_ENABLED=1``, MVAPICH2-GDR with
  ``MV2_USE_CUDA=1``); refused when the library says it has no support.
"""

from __future__ import annotations

import ctypes

from ..errors import MpiflError

CHOICES = ("auto", "pinned", "device")


def cuda_aware() -> bool | None:
    """True / False as ``MPIX_Query_cuda_support()`` answers; None when the library does not export it."""
    from mpi4py import MPI

    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype, query.argtypes = ctypes.c_int, []
    return bool(query())


def device_buffers(choice: str, on_gpu: bool, support: bool | None) -> bool:
    """Whether a rank keeps its message buffers on its GPU (see the module docstring)."""
    if choice not in CHOICES:
        raise MpiflError(f"unknown --gpu-buffers {choice!r}; choose one of: {', '.join(CHOICES)}")
    if choice == "device" and support is False:
        from mpi4py import MPI

        raise MpiflError(f"--gpu-buffers device, but this MPI library is not CUDA-aware "
                         f"({MPI.Get_library_version().splitlines()[0].strip()}); use --gpu-buffers pinned, "
                         "or an MPI built with CUDA support")
    return on_gpu and (choice == "device" or (choice == "auto" and support is True))
