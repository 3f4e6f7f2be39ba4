"""What identifies a request and the weights it ran on: the parameters a record keeps, the checkpoint's
fingerprint, and the key under which an identical seeded request reuses a completed video (`--reuse-completed`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from longserve.engine.images import EncodedImage, is_encoded_video
from longserve.engine.request import GenerationSpec


def stored_params(spec: GenerationSpec) -> dict:
    """The spec's parameters as the record keeps them (JSON), with its fps: an image is kept as its size, a video as
    its frame count and size, not their pixels. A queued job with either is therefore not run again after a
    restart (its input lived in memory only)."""
    params = spec.to_params()
    options = params["options"]
    for name in ("image", "last_image"):
        if name in options:
            height, width = options.pop(name).shape[:2]
            options[name] = f"{width}x{height}"
    if "video" in options:
        frames, height, width = options.pop("video").shape[:3]
        options["video"] = f"{frames} frames {width}x{height}"
    return params


def checkpoint_fingerprint(model_dir, dtype: str, loras=()) -> str:
    """What identifies the served weights for `request_key`: every file's path, size and modification time under
    the checkpoint (a retrained or replaced checkpoint of the same name is another model), and the dtype; and the
    LoRA adapters loaded at start (`engine.lora.LoraAdapter`s): a request names one, so its file and start scale
    are part of what the name means."""
    root = Path(model_dir)
    files = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in root.rglob("*") if p.is_file())
    adapters = [(a.name, a.scale, [(path, Path(path).stat().st_size, Path(path).stat().st_mtime_ns)
                                   for path in (a.path, a.path_2) if path is not None]) for a in loras]
    return hashlib.sha256(json.dumps([str(root.resolve()), dtype, files, *([adapters] if adapters else [])]
                                     ).encode()).hexdigest()


def request_key(checkpoint: str, spec: GenerationSpec, fps: int, adapters=()) -> str:
    """Two create requests with equal keys make the same video: the checkpoint, the prompt, every generation
    parameter with the seed, the fps, and the input images by their pixels' digest."""
    params = spec.to_params()
    options = params["options"]
    for name, value in list(options.items()):
        if isinstance(value, EncodedImage) or is_encoded_video(value):   # an uploaded file: its digest
            options[name] = f"file:{tuple(value.shape)}:{value.digest}"
        elif hasattr(value, "shape") and hasattr(value, "tobytes"):     # an image (numpy array)
            options[name] = f"{value.dtype}:{tuple(value.shape)}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    payload = {"checkpoint": checkpoint, "prompt": spec.prompt, "params": params, "fps": fps}
    named = {e["name"] for e in spec.lora}
    if named:      # the files behind the names it uses (an adapter loaded over HTTP may be replaced under its name)
        payload["adapters"] = [(a.name, a.path, a.path_2, *(os.stat(p).st_mtime_ns for p in (a.path, a.path_2) if p))
                               for a in adapters if a.name in named]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
