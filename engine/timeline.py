"""Prompt timelines for finite long video: a request's `prompts` option,

    prompts=[{"prompt": "a red ball bouncing", "seconds": 4}, {"prompt": "a blue ball bouncing"}]

says which prompt conditions which stretch of the video: each entry lasts its `seconds` (the last may leave them
out: it runs to the end). A family that makes its video in segments (diffusion forcing's segments, Helios' chunks)
gives each segment the prompt of its first new frame's time, so a switch lands on a segment boundary: the model
never sees two prompts inside one segment, and the next segment starts from the frames before it, as any segment
does (the switch is continuous in the picture, not a cut).

The text encoder runs once per distinct prompt (rank 0, with the request's other encodings): a timeline that
returns to a prompt reuses its embedding. The request's `prompt` becomes the timeline's first prompt, what the
first segment is conditioned on and what the video is listed by.

Families that make one segment (Wan, Latte, HunyuanVideo-1.5, SANA-Video, ...) do not take the option: the
check of the family's options refuses it, naming `prompts`.
"""

from __future__ import annotations

import dataclasses
import math

from longserve.engine.request import GenerationSpec, RequestError, check_prompts

OPTION = "prompts"


def check_timeline(spec: GenerationSpec, fps: int) -> GenerationSpec:
    """The `prompts` option validated (RequestError naming the entry's field) and normalised to
    [{"prompt": str, "seconds": float | None}, ...]; the spec's prompt set to the first entry's. A spec without
    the option is returned as it is."""
    timeline = spec.options.get(OPTION)
    if timeline is None:
        return spec
    if not isinstance(timeline, (list, tuple)) or not timeline:
        raise RequestError(OPTION, 'prompts must be a non-empty list of {"prompt": ..., "seconds": ...} entries')
    if spec.batch_size != 1:
        raise RequestError(OPTION, "a prompt timeline makes one video: give one prompt with it, not a list")
    entries, start = [], 0.0
    video_seconds = spec.num_frames / fps
    for i, entry in enumerate(timeline):
        where = f"prompts[{i}]"
        if not isinstance(entry, dict) or "prompt" not in entry:
            raise RequestError(where, f'{where} must be an object {{"prompt": ..., "seconds": ...}}; got {entry!r}')
        unknown = sorted(set(entry) - {"prompt", "seconds"})
        if unknown:
            raise RequestError(f"{where}.{unknown[0]}", f"{where} takes prompt and seconds; got {unknown[0]!r}")
        check_prompts(entry["prompt"], f"{where}.prompt")
        seconds = entry.get("seconds")
        last = i == len(timeline) - 1
        if seconds is None and not last:
            raise RequestError(f"{where}.seconds", f"{where}.seconds is needed: only the last entry may run to "
                                                   f"the end of the video")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not math.isfinite(seconds) or seconds <= 0):
            raise RequestError(f"{where}.seconds", f"{where}.seconds must be a positive number; got {seconds!r}")
        if start >= video_seconds:
            raise RequestError(f"{where}.seconds", f"{where} would start at {start:g} s, after the video's end "
                                                   f"({spec.num_frames} frames at {fps} fps: {video_seconds:g} s)")
        entries.append({"prompt": entry["prompt"], "seconds": None if seconds is None else float(seconds)})
        start += seconds or 0.0
    return dataclasses.replace(spec, prompt=[entries[0]["prompt"]], options={**spec.options, OPTION: entries})


def distinct_prompts(spec: GenerationSpec) -> list[str]:
    """The timeline's prompts, each once, in order of first use (the first is the request's `prompt`)."""
    return list(dict.fromkeys(e["prompt"] for e in spec.options[OPTION]))


def segment_prompts(spec: GenerationSpec, frame_starts: list[int], fps: int) -> list[int]:
    """Per segment, the index in `distinct_prompts` of the prompt at its first new frame (`frame_starts`: each
    segment's first new frame in the finished video). Without a timeline, 0 for every segment."""
    if OPTION not in spec.options:
        return [0] * len(frame_starts)
    names = distinct_prompts(spec)
    ends, t = [], 0.0                       # when each entry ends, in frames (the last: never)
    for e in spec.options[OPTION]:
        t = math.inf if e["seconds"] is None else t + e["seconds"]
        ends.append(t * fps)
    out = []
    for start in frame_starts:
        entry = next((i for i, end in enumerate(ends) if start < end - 1e-9), len(ends) - 1)
        out.append(names.index(spec.options[OPTION][entry]["prompt"]))
    return out


def encode_other_prompts(pipe, spec: GenerationSpec, device, max_sequence_length: int) -> dict:
    """Rank 0: a timeline's distinct prompts after the first (which the request's `prompt` encodes, with the negative
    prompt), each once, by a Wan-style pipeline's `encode_prompt`: {"prompt_texts": (P - 1, L, C)}; {} without."""
    if OPTION not in spec.options or len(distinct_prompts(spec)) == 1:
        return {}
    embeds, _ = pipe.encode_prompt(prompt=distinct_prompts(spec)[1:], negative_prompt=None,
                                   do_classifier_free_guidance=False, num_videos_per_prompt=1,
                                   max_sequence_length=max_sequence_length, device=device)
    return {"prompt_texts": embeds}


def prompt_rows(text, prompt_texts, use_cfg: bool) -> list:
    """Each distinct prompt's forward rows, as the request's `text` holds the first's: [negative; positive] under
    CFG (the negative prompt shared), else the positive alone. text (2|1, L, C); prompt_texts (P - 1, L, C)."""
    import torch

    rows = [text]
    for positive in ([] if prompt_texts is None else prompt_texts.to(text.device, text.dtype).split(1)):
        rows.append(torch.cat([text[:1], positive]) if use_cfg else positive)                # (2|1, L, C)
    return rows
