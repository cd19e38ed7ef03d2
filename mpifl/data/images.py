"""Decoding image files for the converters: RGB, resized once, in parallel batches.

Pillow decodes each image, turns it upright by its EXIF orientation (as a viewer shows it; torchvision's
loader does not, which leaves a camera's rotated photo on its side), makes it 8-bit RGB
(:func:`to_rgb`) and resizes it **once** to ``S x S`` with ``BILINEAR`` (Pillow's bilinear is antialiased:
its kernel widens by the scale factor when shrinking), the aspect ratio not kept (as the
``Resize([256, 256])`` of the public code of FedBN, Li et al., ICLR 2021); an image already ``S x S`` is not
resampled.

8-bit RGB from every mode, each by its own range: grayscale and palettes expanded; CMYK, YCbCr, HSV and Lab
converted by Pillow; 16-bit grayscale (``I;16``, and ``I`` as PNG, PPM and PGM give it) scaled by 255/65535;
32-bit float (``F``) by 255 when its values lie in [0, 1]; transparency (``RGBA``, ``LA``, ``PA``, ``P``
with a transparent colour, premultiplied ``RGBa``) composited over white, as the image shows on a white
page (dropping alpha instead, as ``convert("RGB")`` does, shows whatever colour the transparent pixels
happen to store).  What has no known range (32-bit integer TIFFs, floats outside [0, 1]) is refused, naming
the file: the converter never guesses.  :func:`decoded_batches` keeps a thread pool (Pillow
releases the GIL while decoding and resampling) at most two batches ahead of the consumer.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, ImageOps

from mpifl.errors import MpiflError

#: How images are decoded and resized (the manifest's ``protocol["resize"]``).
RESIZE_NOTE = ("decoded with Pillow, turned upright by EXIF orientation, made 8-bit RGB (16-bit and float "
               "scaled by their range, transparency over white), resized once to SxS (bilinear, antialiased, "
               "aspect ratio not kept)")
_BILINEAR = getattr(Image, "Resampling", Image).BILINEAR


def load_image(path, size: int, fix: str | None = None) -> np.ndarray:
    """The image at ``path`` as uint8 ``size x size x 3``: RGB, resized once (bilinear, antialiased).

    ``fix`` ends the error message for an unreadable image (default: replace or delete the file).
    """
    fix = fix or "replace or delete the file and run prepare again"
    try:
        with Image.open(path) as image:
            rgb = to_rgb(ImageOps.exif_transpose(image), bits_per_sample(image))
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), _BILINEAR)
        pixels = np.asarray(rgb, dtype=np.uint8)
    except UnknownRange as e:
        raise MpiflError(f"cannot convert image {path}: {e}") from None
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
        raise MpiflError(f"cannot read image {path} ({type(e).__name__}: {e}); {fix}") from None
    if pixels.shape != (size, size, 3):
        raise MpiflError(f"cannot read image {path} (decoded to shape {pixels.shape}); {fix}")
    return pixels


class UnknownRange(ValueError):
    """Pixels whose range the file does not say."""


def to_rgb(image: Image.Image, bits: tuple = ()) -> Image.Image:
    """``image`` as 8-bit RGB, each mode scaled by its own range (module docstring); ``bits``: the file's bits
    per sample where it says (TIFF), which tells a 32-bit integer image from a 16-bit one."""
    mode = image.mode
    if mode.startswith("I;16") or mode == "I":
        if mode == "I" and 32 in bits:
            raise UnknownRange("32-bit integer pixels have no known range; save it as 8- or 16-bit")
        gray = np.asarray(image, dtype=np.float64)
        if gray.size and (gray.min() < 0 or gray.max() > 65535):
            raise UnknownRange(f"{mode} pixels span {gray.min():.0f}..{gray.max():.0f}, outside 16 bits")
        return _gray(gray * (255 / 65535))
    if mode == "F":
        gray = np.asarray(image, dtype=np.float64)
        if gray.size and not (np.isfinite(gray).all() and gray.min() >= 0 and gray.max() <= 1):
            raise UnknownRange("float pixels outside [0, 1] have no known range; save it as 8-bit")
        return _gray(gray * 255)
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in image.info):
        rgba = np.asarray(image.convert("RGBA") if mode != "La" else image.convert("LA").convert("RGBA"),
                          dtype=np.float64)
        alpha = rgba[..., 3:] / 255
        return Image.fromarray(np.rint(rgba[..., :3] * alpha + 255 * (1 - alpha)).astype(np.uint8), "RGB")
    return image.convert("RGB")


def _gray(values: np.ndarray) -> Image.Image:
    return Image.fromarray(np.repeat(np.rint(values).astype(np.uint8)[..., None], 3, axis=2), "RGB")


def bits_per_sample(image: Image.Image) -> tuple:
    """A TIFF's BitsPerSample tag (258), () for other files."""
    bits = getattr(image, "tag_v2", {}).get(258, ())
    return bits if isinstance(bits, tuple) else (bits,)


def workers() -> int:
    """Decoding threads: the cores this process may use, 1 to 16."""
    try:
        return max(1, min(16, len(os.sched_getaffinity(0))))
    except AttributeError:
        return max(1, min(16, os.cpu_count() or 1))


def decoded_batches(pool: ThreadPoolExecutor, rows, size: int, batch: int, fix: str | None = None):
    """Yield (images, labels) for ``rows`` in order, keeping two batches decoding ahead."""
    pending = deque()
    try:
        for start in range(0, len(rows), batch):
            chunk = rows[start:start + batch]
            pending.append((chunk, [pool.submit(load_image, path, size, fix) for path, _ in chunk]))
            if len(pending) > 2:
                yield _collect(*pending.popleft())
        while pending:
            yield _collect(*pending.popleft())
    finally:
        for _, futures in pending:
            for future in futures:
                future.cancel()


def _collect(chunk, futures):
    images = np.stack([future.result() for future in futures])
    return images, np.array([label for _, label in chunk], dtype=np.int64)
