"""Images a test uploads: `png_bytes(width, height)`, a PNG of seeded uniform noise (every pixel differs, so an
image-to-video model's output depends on all of it)."""

import io

import numpy as np
import PIL.Image


def png_bytes(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()
