"""Decoding image files for the converters: RGB, resized once, in parallel batches.

Pillow decodes each image (EXIF orientation is not applied, as in torchvision's loader), converts it to
RGB (alpha dropped, palette and grayscale expanded) and resizes it **once** to ``S x S`` with
``BILINEAR`` (Pillow's bilinear is antialiased: its kernel widens by the scale factor when shrinking),
the aspect ratio not kept (as the ``Resize([256, 256])`` of the public code of FedBN, Li et al., ICLR
2021); an image already ``S x S`` is not resampled.  :func:`decoded_batches` keeps a thread pool (Pillow
releases the GIL while decoding and resampling) at most two batches ahead of the consumer.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from mpifl.errors import MpiflError

#: How images are decoded and resized (the manifest's ``protocol["resize"]``).
RESIZE_NOTE = ("decoded with Pillow, converted to RGB, resized once to SxS (bilinear, antialiased, "
               "aspect ratio not kept)")
_BILINEAR = getattr(Image, "Resampling", Image).BILINEAR


def load_image(path, size: int, fix: str | None = None) -> np.ndarray:
    """The image at ``path`` as uint8 ``size x size x 3``: RGB, resized once (bilinear, antialiased).

    ``fix`` ends the error message for an unreadable image (default: replace or delete the file).
    """
    fix = fix or "replace or delete the file and run prepare again"
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), _BILINEAR)
        pixels = np.asarray(rgb, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
        raise MpiflError(f"cannot read image {path} ({type(e).__name__}: {e}); {fix}") from None
    if pixels.shape != (size, size, 3):
        raise MpiflError(f"cannot read image {path} (decoded to shape {pixels.shape}); {fix}")
    return pixels


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
