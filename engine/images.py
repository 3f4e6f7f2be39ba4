"""Input images of image-to-video requests, as plain data: an RGB uint8 array (H, W, 3).

A request's image travels inside its `GenerationSpec` (pickled to every worker), so it is held
as the one form every front door can produce and every worker can hand to diffusers: the
Python API's PIL image or array, and the server's decoded upload, all become `(H, W, 3)` uint8
RGB here; a worker turns it back into the PIL image diffusers' `WanImageToVideoPipeline`
takes (`to_pil`), which is exactly the image the caller gave when that was an RGB PIL image.

Conversions, as diffusers' own helpers make them:
- a PIL image of any mode -> `image.convert("RGB")` (what `diffusers.utils.load_image` does; the
  pipeline's processors take RGB);
- a float array in [0, 1] -> `round(x * 255)` as uint8 (`VaeImageProcessor.numpy_to_pil`);
- a 2-D array, or (H, W, 1) -> grey replicated to RGB; (H, W, 4) -> its RGB channels (PIL's
  RGBA -> RGB conversion drops alpha the same way).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from longserve.engine.request import RequestError

#: the largest image a request may carry (pixels): a 16k x 16k frame; larger is refused, naming the field
MAX_IMAGE_PIXELS = 1 << 28


@dataclass(frozen=True, eq=False)
class EncodedImage:
    """An image as its file holds it (PNG, JPEG or WebP bytes) that a front door already checked: its header within
    the door's pixel limit, and a full decode that succeeded. What a queued request keeps instead of its pixels (a
    49 KB all-black 4096x4096 PNG is 48 MiB decoded): it is decoded again where it is used, on the worker that
    encodes the request's conditions at admission (`to_pil`). `width`, `height` are its size; `digest` the
    sha256 of its bytes (what makes two requests' images the same for repeat reuse)."""

    data: bytes
    width: int
    height: int
    digest: str

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, 3)

    @property
    def nbytes(self) -> int:
        """What it holds in memory: its file's bytes."""
        return len(self.data)

    def decode(self) -> np.ndarray:
        """(H, W, 3) uint8 RGB, as the door decoded it (the first frame, converted to RGB)."""
        import PIL.Image

        with PIL.Image.open(io.BytesIO(self.data), formats=IMAGE_FORMATS) as image:
            return np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8))


#: the image files a front door takes (Pillow is asked to try these and no other format)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def input_bytes(options: dict) -> int:
    """The bytes a request's inputs hold while it waits (its images and videos, as they are kept: arrays, or the
    files of `EncodedImage` and `pipelines.media.EncodedVideo`)."""
    return sum(v.nbytes for v in options.values()
               if isinstance(v, (np.ndarray, EncodedImage)) or is_encoded_video(v))


def is_encoded_video(value) -> bool:
    """A video kept as its file by a front door (`pipelines.media.EncodedVideo`: checked there, decoded on the
    worker by its `decode()`): anything with `decode()` and a (T, H, W, 3) `shape`."""
    return callable(getattr(value, "decode", None)) and len(getattr(value, "shape", ())) == 4


def video_frames(value) -> np.ndarray:
    """A request's video as frames: an encoded one decoded here (on the worker), an array as it is."""
    return value.decode() if is_encoded_video(value) else value


def as_rgb_array(value, field: str) -> np.ndarray:
    """A PIL image or an (H, W[, C]) array -> a C-contiguous uint8 (H, W, 3) RGB array; RequestError naming
    `field` for anything else. An `EncodedImage` (checked by its door) stays as it is: it is decoded on the
    workers."""
    if isinstance(value, EncodedImage):
        _check_pixels(field, value.width, value.height)
        return value
    try:
        import PIL.Image
    except ImportError:          # pragma: no cover - Pillow is a dependency of diffusers
        PIL = None
    if PIL is not None and isinstance(value, PIL.Image.Image):
        if value.width * value.height == 0:
            raise RequestError(field, f"{field} is an empty image ({value.width}x{value.height})")
        _check_pixels(field, value.width, value.height)
        return np.ascontiguousarray(np.asarray(value.convert("RGB"), dtype=np.uint8))
    if not isinstance(value, np.ndarray):
        raise RequestError(field, f"{field} must be a PIL image or an (H, W, 3) array; got {type(value).__name__}")
    array = value
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2:
        array = np.stack([array] * 3, axis=2)
    if array.ndim != 3 or array.shape[2] not in (3, 4):
        raise RequestError(field, f"{field} must be shaped (H, W), (H, W, 1), (H, W, 3) or (H, W, 4); "
                                  f"got {value.shape}")
    array = array[:, :, :3]
    height, width = array.shape[:2]
    if height * width == 0:
        raise RequestError(field, f"{field} is an empty image ({width}x{height})")
    _check_pixels(field, width, height)
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise RequestError(field, f"{field}: a float image must hold values in [0, 1]")
        return np.ascontiguousarray((array * 255).round().astype(np.uint8))
    raise RequestError(field, f"{field} must be a uint8 array, or floats in [0, 1]; got dtype {array.dtype}")


def _check_pixels(field: str, width: int, height: int) -> None:
    if width * height > MAX_IMAGE_PIXELS:
        raise RequestError(field, f"{field} is {width}x{height} = {width * height} pixels; the limit is "
                                  f"{MAX_IMAGE_PIXELS}")


def to_pil(array: np.ndarray):
    """The (H, W, 3) uint8 array (or an `EncodedImage`, decoded here) -> the RGB PIL image diffusers' pipelines
    take."""
    import PIL.Image

    if isinstance(array, EncodedImage):
        array = array.decode()

    return PIL.Image.fromarray(np.ascontiguousarray(array, dtype=np.uint8))      # (H, W, 3) uint8: RGB


def as_video_array(value, field: str) -> np.ndarray:
    """A video's frames -> a C-contiguous uint8 (T, H, W, 3) RGB array; RequestError naming `field` otherwise.

    Taken: a (T, H, W, C) array (uint8, or floats in [0, 1]: diffusers' "np" frames), or a list of PIL images
    or (H, W[, C]) arrays of one size (diffusers' `video: list[PIL.Image]`). Every frame is converted as
    `as_rgb_array` converts an image. A path is not read here (the engine reads no files): the Python pipeline
    and the front doors decode MP4 files (`pipelines/media.py`)."""
    if is_encoded_video(value):         # checked by its door; decoded on the worker that encodes its conditions
        return value
    if isinstance(value, np.ndarray):
        if value.ndim != 4:
            raise RequestError(field, f"{field} must be shaped (T, H, W, 3) (or (T, H, W, 1) / (T, H, W, 4)); "
                                      f"got {value.shape}")
        frames = list(value)
    elif isinstance(value, (list, tuple)):
        frames = list(value)
    else:
        kind = "a path" if isinstance(value, (str, bytes)) or hasattr(value, "__fspath__") else type(value).__name__
        raise RequestError(field, f"{field} must be frames: a (T, H, W, 3) array or a list of PIL images; got {kind} "
                                  f"(VideoPipeline reads an MP4 path itself)")
    if not frames:
        raise RequestError(field, f"{field} has no frames")
    out = [as_rgb_array(f, field) for f in frames]
    if len({f.shape for f in out}) > 1:
        raise RequestError(field, f"{field}: every frame must have the same size; got "
                                  f"{sorted({f'{f.shape[1]}x{f.shape[0]}' for f in out})}")
    return np.ascontiguousarray(np.stack(out))                                       # (T, H, W, 3) uint8
