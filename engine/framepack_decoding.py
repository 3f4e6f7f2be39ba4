"""FramePack's frames as diffusers' `HunyuanVideoFramepackPipeline` decodes them: each section's latents (with the
frames of the section before it, or the image's) through the whole-clip VAE decode, then blended into the video made
so far over `(latent_window_size - 1) * 4 + 1` frames (`_soft_append`, a linear cross-fade), on rank 0.

`SectionStream` is the request's frame stream (the interface of `engine.decoding.FrameStream` the engine reads:
`ready`, `next`, `frames_out`, `handed_out`). Vanilla sampling hands out every frame the next section's blend can
no longer change: a section's decode less the blended tail, which rank 0 keeps (pixels of one overlap) until the next
section blends into it. Inverted anti-drifting sampling makes the video from its end back to its start, so its
frames go out in one piece once the last section (the video's first) is decoded.
"""

from __future__ import annotations

import collections

import torch

from longserve.engine.decoding import decoded_frames, to_pixels


class SectionStream:
    """One FramePack request's sections, decoded as they come: pixels (B, n, H, W, 3) on rank 0, None elsewhere."""

    def __init__(self, pipe, rank: int, output: str, limit: int, window: int, sampling: str):
        self.pipe, self.rank, self.output, self.limit, self.window = pipe, rank, output, limit, window
        self.inverted = sampling != "vanilla"
        self.temporal = pipe.vae_scale_factor_temporal
        self.overlap = decoded_frames(window, self.temporal)     # the frames a section's decode blends over
        self.pieces = collections.deque()     # [(latents to decode (B, C, k, h, w), first, last)]
        self.latent_parts: list = []          # output "latent": the video's latent frames, in time order
        self.complete = False
        self.frames_out = 0
        self.tail = None                      # rank 0, vanilla: the last `overlap` frames, not final yet
        self.made = 0                         # frames of the blended video made so far (every rank counts them)

    def push(self, decode: torch.Tensor, first: bool, last: bool, new: torch.Tensor) -> None:
        """A finished section: the latents the pipeline decodes for it, and its own new latent frames."""
        self.pieces.append((decode, first, last))
        if self.output == "latent":
            if self.inverted:
                self.latent_parts.insert(0, new)
            else:
                self.latent_parts.append(decode if first else new)
        self.complete = self.complete or last

    def handed_out(self) -> tuple[None, None]:
        """What goes with the frames handed out (`FrameStream.handed_out`): FramePack makes no sound and no live
        chunks."""
        return None, None

    def ready(self) -> bool:
        if self.output == "latent" or self.inverted:
            return self.complete and bool(self.pieces)
        return bool(self.pieces)

    def next(self, max_frames: int):
        """The frames that are final now (whole sections; `max_frames` is not split further). Collective."""
        if self.output == "latent":
            self.pieces.clear()
            self.frames_out = self.limit
            return torch.cat(self.latent_parts, dim=2).cpu() if self.rank == 0 else None
        if self.inverted:
            return self._inverted()
        decode, first, last = self.pieces.popleft()
        n = decoded_frames(decode.shape[2], self.temporal)
        self.made = n if first else self.made - self.overlap + n
        stop = self.limit if last else self.made - self.overlap
        start, self.frames_out = self.frames_out, stop
        if self.rank != 0:
            return None
        video = self._decode(decode)                                          # (B, 3, n, H, W)
        if not first:
            video = torch.cat([self._blend(self.tail, video[:, :, :self.overlap]), video[:, :, self.overlap:]], 2)
        keep = stop - (self.made - video.shape[2])            # the blended video's frames [.., stop) are final
        self.tail = None if last else video[:, :, -self.overlap:]
        return to_pixels(video[:, :, keep - (stop - start):keep], self.pipe.video_processor, self.output)

    def _inverted(self):
        """Every section, the video's end first: each decode goes before the video made so far."""
        video = None
        while self.pieces:
            decode, _, _ = self.pieces.popleft()
            if self.rank == 0:
                current = self._decode(decode)
                video = current if video is None else torch.cat(
                    [current[:, :, :-self.overlap], self._blend(current[:, :, -self.overlap:],
                                                                video[:, :, :self.overlap]),
                     video[:, :, self.overlap:]], dim=2)
        self.frames_out = self.limit
        return None if video is None else to_pixels(video[:, :, :self.limit], self.pipe.video_processor, self.output)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        with torch.no_grad():
            return vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]

    def _blend(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        """`_soft_append`'s cross-fade: weights 1 -> 0 on `before`, 0 -> 1 on `after` (B, 3, overlap, H, W)."""
        weights = torch.linspace(1, 0, self.overlap, dtype=before.dtype, device=before.device).view(1, 1, -1, 1, 1)
        return weights * before + (1 - weights) * after

    def close(self) -> None:
        self.pieces.clear()
        self.tail = None
