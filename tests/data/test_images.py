"""Decoding images for the converters: 8-bit RGB from every Pillow mode, each by its own range, upright,
resized once; what has no known range is refused by name."""

from __future__ import annotations

import re

import numpy as np
import pytest
from PIL import Image

from mpifl.data.images import load_image
from mpifl.errors import MpiflError

_BILINEAR = getattr(Image, "Resampling", Image).BILINEAR
RAMP16 = np.linspace(0, 65535, 64).reshape(8, 8).astype(np.uint16)  # black to white in 16 bits
WHITE = np.array([255, 255, 255])


def _gray(got: np.ndarray) -> np.ndarray:
    assert got.shape == (8, 8, 3) and got.dtype == np.uint8
    assert (got == got[..., :1]).all()  # gray: three equal channels
    return got[..., 0]


def test_load_image_converts_to_rgb_and_resizes_once(tmp_path):
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (9, 13, 3), dtype=np.uint8)
    cases = {"rgb.png": Image.fromarray(rgb), "gray.png": Image.fromarray(rgb[..., 0]),
             "pal.png": Image.fromarray(rgb).convert("P"), "photo.jpg": Image.fromarray(rgb)}
    for name, image in cases.items():
        image.save(tmp_path / name)
        with Image.open(tmp_path / name) as im:
            decoded = im.convert("RGB")
        got = load_image(tmp_path / name, 6)
        assert got.shape == (6, 6, 3) and got.dtype == np.uint8
        assert np.array_equal(got, np.asarray(decoded.resize((6, 6), _BILINEAR)))
    Image.fromarray(rgb[:9, :9]).save(tmp_path / "square.png")
    assert np.array_equal(load_image(tmp_path / "square.png", 9), rgb[:9, :9])  # no resampling


@pytest.mark.parametrize("name,write", [
    ("i16.png", lambda path: Image.fromarray(RAMP16).save(path)),  # mode I;16
    ("i16.tif", lambda path: Image.fromarray(RAMP16).save(path)),  # mode I;16
    ("i16.pgm", lambda path: path.write_bytes(b"P5\n8 8\n65535\n" + RAMP16.astype(">u2").tobytes())),  # mode I
])
def test_16_bit_grayscale_is_scaled_by_its_range(tmp_path, name, write):
    write(tmp_path / name)
    gray = _gray(load_image(tmp_path / name, 8))
    assert np.array_equal(gray, np.rint(RAMP16 / 257).astype(np.uint8))  # not 97 % white
    assert gray.min() == 0 and gray.max() == 255 and (gray == 255).mean() < 0.05


def test_float_in_0_1_is_scaled_by_255(tmp_path):
    ramp = np.linspace(0, 1, 64).reshape(8, 8).astype(np.float32)
    Image.fromarray(ramp).save(tmp_path / "f.tif")  # mode F
    assert np.array_equal(_gray(load_image(tmp_path / "f.tif", 8)), np.rint(ramp.astype(np.float64) * 255))


@pytest.mark.parametrize("name,pixels,said", [
    ("f.tif", np.linspace(-1, 3, 64).reshape(8, 8).astype(np.float32), "float pixels outside [0, 1]"),
    ("i32.tif", (np.arange(64).reshape(8, 8) * 1000).astype(np.int32), "32-bit integer pixels have no known range"),
])
def test_pixels_of_unknown_range_are_refused_by_name(tmp_path, name, pixels, said):
    Image.fromarray(pixels).save(tmp_path / name)
    with pytest.raises(MpiflError, match=re.escape(f"cannot convert image {tmp_path / name}: {said}")):
        load_image(tmp_path / name, 8)


def test_cmyk_is_converted_by_its_ink(tmp_path):
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "c.jpg", quality=100)  # magenta + yellow = red
    Image.new("CMYK", (8, 8), (0, 0, 0, 255)).save(tmp_path / "k.tif")  # full black ink
    assert (np.abs(load_image(tmp_path / "c.jpg", 8).astype(int) - [255, 0, 0]) <= 2).all()
    assert (load_image(tmp_path / "k.tif", 8) == 0).all()


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_composited_over_white(tmp_path, mode):
    """Left half opaque red (or gray 76 without colour), right half transparent over a black stored colour."""
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[:, :4] = [255, 0, 0, 255]
    image = Image.fromarray(rgba, "RGBA")
    if mode == "LA":
        image = image.convert("LA")
    elif mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=2)
        image.info["transparency"] = image.getpixel((7, 0))  # the transparent colour's palette index
    image.save(tmp_path / "t.png")
    with Image.open(tmp_path / "t.png") as check:
        assert check.mode == mode and (mode != "P" or "transparency" in check.info)
    got = load_image(tmp_path / "t.png", 8)
    opaque = [76, 76, 76] if mode == "LA" else [255, 0, 0]
    assert (got[:, :4] == opaque).all() and (got[:, 4:] == WHITE).all()  # not black: convert("RGB") shows black


@pytest.mark.parametrize("mode", ["L", "1"])
def test_grayscale_and_bilevel_are_expanded(tmp_path, mode):
    gray = np.zeros((8, 8), np.uint8)
    gray[:, 4:] = 255
    Image.fromarray(gray).convert(mode).save(tmp_path / "g.png")
    assert np.array_equal(_gray(load_image(tmp_path / "g.png", 8)), gray)


def test_exif_orientation_turns_the_image_upright(tmp_path):
    """A camera's portrait photo stored sideways (orientation 6: turn 90 degrees clockwise to view)."""
    stored = np.zeros((8, 16, 3), np.uint8)
    stored[:, :8] = 255  # the left half of the stored image is the top of the upright one
    image = Image.fromarray(stored)
    exif = image.getexif()
    exif[0x0112] = 6
    image.save(tmp_path / "o.png", exif=exif.tobytes())
    got = load_image(tmp_path / "o.png", 16)
    assert (got[:7].mean() > 200) and (got[9:].mean() < 50)  # upright: white on top, black below
