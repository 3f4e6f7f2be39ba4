"""Uploaded images (`input_reference`, and the `last_image` extension): checked, then decoded to (H, W, 3) uint8.
(An `input_reference` whose bytes are an MP4 is the video a diffusion-forcing model extends: the service hands
it to `pipelines/media.py`'s `read_mp4`, which checks it in the same order.)

The openai client sends `videos.create(input_reference=open("cat.png", "rb"))` as a multipart/form-data file
part named `input_reference` (its filename, a content type guessed from it); a JSON body may carry OpenAI's
`{"image_url": "data:image/png;base64,..."}` form instead (a data URL only: the server downloads nothing).

The order of the checks is the point (every refusal is a 400 naming the field, nothing is written to disk):
1. the bytes' own signature picks the decoder, among PNG, JPEG and WebP only (Pillow is asked to try
   those three formats and no other; a declared content type is not trusted);
2. the header gives the pixel count, checked against `max_pixels` BEFORE any pixel is decoded
   (`PIL.Image.open` is lazy: it reads the header only), so a small file that would decompress to a huge
   frame (a decompression bomb) costs nothing;
3. a truncated or damaged file fails here: a PNG's chunks are read and their CRCs checked (`verify()`, no pixel
   decoded), a JPEG or WebP is decoded (`load()`; Pillow's LOAD_TRUNCATED_IMAGES stays off). A PNG whose
   compressed pixels are damaged behind right CRCs (a crafted file) fails where it is decoded, on the worker that
   admits it: that request fails alone (`engine/worker.py`'s admit), the pool stays up;
4. the file itself is kept (`engine.images.EncodedImage`: its bytes, size and digest), not its pixels: a queued job
   holds a 49 KB PNG, not the 48 MiB it decodes to; the worker that admits the job decodes it again, takes its
   first frame and converts it to RGB (`diffusers.utils.load_image`'s rule).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

from longserve.engine.images import IMAGE_FORMATS, EncodedImage
from longserve.server.api.errors import APIError

FORMATS = IMAGE_FORMATS


@dataclass(frozen=True)
class Upload:
    """A file part of a multipart body, read into memory (starlette's spooled temporary file is closed)."""

    data: bytes
    filename: str | None = None
    content_type: str | None = None


def image_bytes(value, field: str) -> bytes:
    """The bytes of an uploaded image: a multipart file, or a JSON `{"image_url": "data:...;base64,..."}`."""
    if isinstance(value, Upload):
        return value.data
    if isinstance(value, dict) and set(value) <= {"image_url", "file_id"}:
        url = value.get("image_url")
        if not isinstance(url, str) or not url.startswith("data:"):
            raise APIError(400, f"{field}: only an uploaded file (multipart/form-data) or a base64 data URL "
                                f"{{\"image_url\": \"data:image/png;base64,...\"}} is accepted; this server "
                                f"fetches no URLs and stores no files", param=field, code="invalid_value")
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise APIError(400, f"{field}: the data URL must be base64-encoded", param=field, code="invalid_value")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, f"{field}: the data URL is not valid base64", param=field,
                           code="invalid_value") from None
    raise APIError(400, f"{field} must be an image file (send it as a multipart/form-data file field "
                        f"{field}), not {type(value).__name__}", param=field, code="invalid_value")


def decode_image(data: bytes, field: str, max_pixels: int) -> EncodedImage:
    """A PNG, JPEG or WebP file, checked and decoded once -> the file itself as an `EncodedImage` (what a queued
    job keeps: its bytes, not its pixels); APIError 400 naming `field` otherwise (see module doc)."""
    import PIL.Image

    if not data:
        raise APIError(400, f"{field} is an empty file", param=field, code="invalid_image")
    try:
        image = PIL.Image.open(io.BytesIO(data), formats=FORMATS)          # the header only
    except PIL.Image.DecompressionBombError as e:
        raise APIError(400, f"{field} is too large to decode: {e}", param=field, code="image_too_large") from None
    except (PIL.UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise APIError(400, f"{field} must be a PNG, JPEG or WebP image; this file is none of them (or its header "
                            f"is damaged)", param=field, code="unsupported_image") from None
    with image:
        width, height = image.size
        if width * height > max_pixels:
            raise APIError(400, f"{field} is {width}x{height} = {width * height} pixels; the limit is {max_pixels} "
                                f"(checked before decoding)", param=field, code="image_too_large")
        if width * height == 0:
            raise APIError(400, f"{field} has no pixels ({width}x{height})", param=field, code="invalid_image")
        try:
            if image.format == "PNG":
                image.verify()    # every chunk there and its CRC right, no pixel decoded (the worker decodes it)
            else:
                image.load()                                                # decodes: truncated files fail here
        except PIL.Image.DecompressionBombError as e:
            raise APIError(400, f"{field} is too large to decode: {e}", param=field,
                           code="image_too_large") from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise APIError(400, f"{field} could not be decoded (truncated or damaged {image.format} file: {e})",
                           param=field, code="invalid_image") from None
    # kept as its file (a queued job holds its bytes, not its pixels); decoded again on the worker at admission
    return EncodedImage(data, width, height, hashlib.sha256(data).hexdigest())
