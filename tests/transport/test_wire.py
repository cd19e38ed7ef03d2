import numpy as np
import pytest
import torch

from mpifl.transport.wire import TensorSpec, WireLayout, specs_of


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g),
        "steps": torch.tensor(7, dtype=torch.int64),
        "b.half": torch.randn(4, generator=g).half(),
        "meta": torch.randn(2, generator=g, dtype=torch.float64),
        "mask": torch.tensor([1, 0, 255], dtype=torch.uint8),
    }


def test_round_trip_is_exact_and_views_alias_the_buffer():
    tensors = _tensors()
    layout = WireLayout(specs_of(tensors))
    buf = layout.pack(tensors)
    assert buf.dtype == np.uint8 and buf.nbytes == 96  # 95 bytes of tensors, padded to a multiple of 8
    views = layout.unpack(buf)
    for name, tensor in tensors.items():
        assert np.array_equal(views[name], tensor.numpy())
    views["a.weight"][0, 0] = 42.0
    assert layout.unpack(buf)["a.weight"][0, 0] == 42.0


def test_offsets_are_aligned_to_item_size_and_the_size_padded_to_8_bytes_with_zeros():
    tensors = _tensors()
    layout = WireLayout(specs_of(tensors))
    for spec in layout.specs:
        assert layout.offsets[spec.name] % spec.itemsize == 0
    assert layout.used == sum(s.nbytes for s in layout.specs) == 95 and layout.nbytes == 96
    buf = np.full(layout.nbytes, 0xAB, dtype=np.uint8)
    layout.pack(tensors, out=buf)
    assert buf[95] == 0
    even = WireLayout([TensorSpec("w", (6,), torch.float32)])
    assert even.nbytes == even.used == 24


def test_a_torch_buffer_gives_tensor_views_and_layouts_back_to_back_stay_aligned():
    tensors = _tensors()
    layout = WireLayout(specs_of(tensors))
    buf = torch.zeros(2 * layout.nbytes, dtype=torch.uint8)
    for k in range(2):  # the second starts at 96: its float64 views need that 8-byte alignment
        layout.pack(tensors, out=buf[k * layout.nbytes:(k + 1) * layout.nbytes])
    views = layout.unpack(buf[layout.nbytes:])
    for name, tensor in tensors.items():
        assert isinstance(views[name], torch.Tensor) and torch.equal(views[name], tensor)
    views["meta"][0] = 42.0
    assert layout.unpack(buf[layout.nbytes:])["meta"][0] == 42.0


def test_pack_refuses_tensors_outside_the_layout_and_missing_ones():
    tensors = _tensors()
    layout = WireLayout(specs_of(tensors))
    with pytest.raises(ValueError, match="extra"):
        layout.pack({**tensors, "secret": torch.zeros(1)})
    missing = dict(tensors)
    missing.pop("steps")
    with pytest.raises(ValueError, match="missing"):
        layout.pack(missing)
    with pytest.raises(ValueError, match="shape"):
        layout.pack({**tensors, "a.weight": torch.zeros(5, 3)})


def test_duplicate_names_rejected():
    with pytest.raises(ValueError):
        WireLayout([TensorSpec("x", (1,), torch.float32), TensorSpec("x", (2,), torch.float32)])


def test_pack_into_a_slice_of_a_larger_buffer():
    tensors = _tensors()
    layout = WireLayout(specs_of(tensors))
    big = np.zeros(layout.nbytes * 2, dtype=np.uint8)
    layout.pack(tensors, out=big[layout.nbytes:])
    assert not big[:layout.nbytes].any()
    assert np.array_equal(layout.unpack(big[layout.nbytes:])["meta"], tensors["meta"].numpy())
