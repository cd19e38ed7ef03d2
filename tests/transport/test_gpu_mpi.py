import pytest
from mpi4py import MPI

from mpifl.errors import MpiflError
from mpifl.transport.gpu_mpi import cuda_aware, device_buffers


@pytest.mark.parametrize("choice, on_gpu, support, expected", [
    ("auto", True, True, True),
    ("auto", True, None, False),  # unknown: stay on the safe side
    ("auto", True, False, False),
    ("auto", False, True, False),  # a CPU rank has no GPU to put them on
    ("pinned", True, True, False),
    ("device", True, None, True),  # the user vouches for a library that cannot say
    ("device", True, True, True),
    ("device", False, None, False),
])
def test_gpu_buffers_only_when_on_a_gpu_and_the_library_supports_them(choice, on_gpu, support, expected):
    assert device_buffers(choice, on_gpu, support) is expected


def test_device_buffers_are_refused_for_a_library_that_says_it_is_not_cuda_aware():
    with pytest.raises(MpiflError, match="not CUDA-aware.*--gpu-buffers pinned"):
        device_buffers("device", True, False)
    with pytest.raises(MpiflError, match="unknown --gpu-buffers"):
        device_buffers("gpu", True, True)


@pytest.mark.skipif("MPICH" not in MPI.Get_library_version(), reason="the oracle reads MPICH's configure line")
def test_the_query_agrees_with_how_mpich_was_built():
    built_with_cuda = "--with-cuda" in MPI.Get_library_version()
    assert cuda_aware() is (True if built_with_cuda else False)
