"""A job's uploaded inputs as files, so that any replica can run it: an `input_reference` image, a `last_image`, the
video an extension continues (`/extend`, or an MP4 `input_reference`). The creating replica puts them in the shared
media store (`StoredFiles.put_inputs`: `<media>/inputs/<id>/`, or objects `inputs/<id>/...`) before it stores the
job; the replica that claims it reads them back (`Replica.claim`). An image or a video is kept as the file the door
checked, with what the door measured (`inputs.json`): the worker decodes it again, as it does on the replica that
took the request; a decoded array (the Python API's) as `.npy`, read without pickle.
"""

from __future__ import annotations

import io
import json

import numpy as np

#: the options whose value is an upload (`service.stored_params` keeps only their shape in the record)
INPUTS = ("image", "last_image", "video")
META = "inputs.json"


def pack_inputs(options: dict) -> dict[str, bytes]:
    """The files of a spec's uploaded inputs (name -> bytes): each input's bytes, and what they are (`META`)."""
    from longserve.engine.images import EncodedImage
    from longserve.pipelines.media import EncodedVideo

    files, meta = {}, {}
    for name in INPUTS:
        value = options.get(name)
        if isinstance(value, EncodedImage):
            files[name] = bytes(value.data)
            meta[name] = {"kind": "image", "width": value.width, "height": value.height, "digest": value.digest}
        elif isinstance(value, EncodedVideo):
            files[name] = bytes(value.data)
            meta[name] = {"kind": "video", "frames": value.frames, "width": value.width, "height": value.height,
                          "digest": value.digest, "max_pixels": value.max_pixels}
        elif isinstance(value, np.ndarray):
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(value), allow_pickle=False)
            files[name] = buf.getvalue()
            meta[name] = {"kind": "array"}
        elif value is not None:
            raise TypeError(f"the {name} input cannot be stored ({type(value).__name__})")
    files[META] = json.dumps(meta).encode()
    return files


def unpack_inputs(files: dict[str, bytes]) -> dict:
    """The options `pack_inputs` made its files of. ValueError when one is missing or unreadable."""
    from longserve.engine.images import EncodedImage
    from longserve.pipelines.media import EncodedVideo

    try:
        meta = json.loads(files[META])
        options = {}
        for name, m in meta.items():
            data = files[name]
            if m["kind"] == "image":
                options[name] = EncodedImage(data, int(m["width"]), int(m["height"]), str(m["digest"]))
            elif m["kind"] == "video":
                options[name] = EncodedVideo(data, int(m["frames"]), int(m["width"]), int(m["height"]),
                                             str(m["digest"]), m.get("max_pixels"))
            else:
                options[name] = np.load(io.BytesIO(data), allow_pickle=False)
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"the job's stored inputs are incomplete or unreadable ({e!r})") from None
    return options


def read_inputs(store, rec) -> dict | None:
    """A claimed job's uploaded inputs, read back from `store`'s media (`StoredFiles.get_inputs`): {} for a job
    without any, None when they are not there (the media store is not shared, or they were removed)."""
    uploads = set(INPUTS) & set(rec.params.get("options") or {})
    if not uploads:
        return {}
    if not store.shared:
        return None
    files = store.get_inputs(rec.id, [META])
    names = list(json.loads(files[META])) if files is not None else []
    if not set(names) >= uploads:
        return None
    files = store.get_inputs(rec.id, [META, *names])
    return None if files is None else unpack_inputs(files)
