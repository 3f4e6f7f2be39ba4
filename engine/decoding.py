"""Final latents -> frames, written once for every family: one `FrameStream` per request.

A family pushes a request's latent frames into its stream as they become final; *which* frames are final, and when,
is the family's own loop:

    text-to-video (Latte, Wan T2V/I2V/TI2V)   every latent frame, once the last step is done
    diffusion forcing (skyreels_df)           each segment's new frames as its last step ends
    Helios                                    each chunk as its last stage ends
    causal (live)                             each chunk once denoised, with its chunk and prompt index

The stream's `FramesPolicy` says how pushed frames turn into the frames a request hands out: how many pixel frames
a run of latent frames decodes to (a causal VAE makes 1 + (k - 1) * temporal of k), whether a run restarts the
VAE's cache (Helios decodes each chunk on its own, as diffusers does), whether each push is handed out whole (a live
chunk is the unit a client sees), and what comes before or is dropped (an extension hands out the input video's
frames first, and drops the decoded frames that re-make the input's end). `next(max_frames)` takes the next final
latent frames whose frames fit in `max_frames` (at least one frame), decodes them through the family's VAE path
(`WanVAEDecoder`: engine/causal_vae.py's `StreamingVAEDecoder` across the workers; Latte's per-frame split) and
returns rank 0's pixels. Output "latent" hands the latents out instead: a live chunk at a time, else all of them in
one piece once the last is pushed.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from longserve.engine.outputs import LiveChunkInfo, Sound


def decoded_frames(latent_frames: int, temporal: int) -> int:
    """Pixel frames a causal VAE makes of `latent_frames` (the first latent frame is one frame)."""
    return 0 if latent_frames <= 0 else 1 + (latent_frames - 1) * temporal


@dataclass(frozen=True)
class FramesPolicy:
    """How a request's final latent frames become the frames it hands out."""

    temporal: int = 1            # the VAE's time compression
    run: int = 0                 # latent frames decoded on their own, with a fresh VAE cache (Helios: a chunk); 0: one
    whole: bool = False          # each push is handed out whole, one per call, whatever `max_frames` (a live chunk)
    lead: int = 0                # frames handed out before any decoded one (an extension's input video)
    skip: int = 0                # decoded frames not handed out, at the start (an extension's re-made overlap)

    def made(self, latent_frames: int) -> int:
        """Pixel frames the VAE makes of the first `latent_frames` latent frames."""
        if not self.run:
            return decoded_frames(latent_frames, self.temporal)
        runs, part = divmod(latent_frames, self.run)
        return runs * decoded_frames(self.run, self.temporal) + decoded_frames(part, self.temporal)

    def out(self, latent_frames: int, limit: int) -> int:
        """Frames handed out once `latent_frames` latent frames are decoded: the lead, then the made frames past
        `skip`, at most `limit`."""
        return min(limit, self.lead + max(0, self.made(latent_frames) - self.skip))


class FrameStream:
    """One request's final latents, in order, and the frames handed out of them (identical on every rank).

    open_decoder(latents) -> the family's VAE path for a run that starts with `latents` (B, C, k, h, w): an object
    with `decode(latents, keep)` (collective: pixels (B, n, H, W, 3) of the decoded frames `keep` on rank 0, None
    elsewhere) and `close()`. limit: the frames the request hands out (a live stop lowers it). lead_frames(start,
    stop): rank 0's pixels of the lead's frames [start, stop)."""

    def __init__(self, policy: FramesPolicy, open_decoder: Callable, output: str, rank: int, limit: int,
                 lead_frames: Callable | None = None):
        self.policy, self.open_decoder, self.output, self.rank = policy, open_decoder, output, rank
        self.limit = limit
        self.lead_frames = lead_frames
        self.pieces = collections.deque()   # [(latents (B, C, k, h, w), live)]: final, not handed out yet
        self.complete = False               # the last piece is in
        self.latents_done = 0               # latent frames handed out
        self.frames_out = 0                 # frames handed out
        self.decoder = None                 # the VAE path of the current run, once it started
        self.live: LiveChunkInfo | None = None   # the last handed-out piece's (a causal chunk: its index and prompt)
        self.audio: Sound | None = None     # a sound the family made, handed out with the next frames (`handed_out`)

    def push(self, latents: torch.Tensor, live: LiveChunkInfo | None = None, last: bool = False) -> None:
        """Final latent frames (B, C, k, h, w), after those pushed before; `last`: no more will come."""
        self.pieces.append((latents, live))
        self.complete = self.complete or last

    def handed_out(self) -> tuple[Sound | None, LiveChunkInfo | None]:
        """What goes with the frames just handed out: the family's sound (once), and the chunk they are."""
        audio, self.audio = self.audio, None
        return audio, self.live

    def ready(self) -> bool:
        """Is there something to hand out?"""
        if self.output == "latent" and not self.policy.whole:
            return self.complete and bool(self.pieces)
        return self.frames_out < self.policy.lead or bool(self.pieces)

    def next(self, max_frames: int):
        """The next frames (about `max_frames`, at least one): pixels (B, n, H, W, 3) on rank 0, None elsewhere;
        or latents for output "latent". Collective: every rank calls it in the same order."""
        return self.take(max_frames)()

    def take(self, max_frames: int) -> Callable:
        """`next` in two parts: the stream's bookkeeping now (which frames, and the counts after them), and the
        decode as the function returned, to call later and maybe elsewhere (the live loop's decode lane,
        engine/live_lane.py). The returned functions must be called in the order they were taken: the VAE path's
        cache carries from one to the next."""
        if self.output == "latent":
            latents = self._latents()
            return lambda: latents
        p, start = self.policy, self.frames_out
        if start < p.lead:                            # an extension's input frames first (rank 0 holds them)
            stop = self.frames_out = min(p.lead, start + max_frames)
            pixels = self.lead_frames(start, stop) if self.rank == 0 else None
            if stop == p.lead:
                self.lead_frames = None                # handed out: not kept
            return lambda: pixels
        before = self.latents_done
        latents, self.live = self._take(self._count(max_frames))
        self.latents_done += latents.shape[2]
        self.frames_out = p.out(self.latents_done, self.limit)
        first = max(0, p.skip - p.made(before))       # the decoded frames this call hands out: past skip, to limit
        keep = slice(first, first + self.frames_out - start)
        last = bool((p.run and self.latents_done % p.run == 0) or self.frames_out >= self.limit)
        return lambda: self._decode(latents, keep, last)

    def _decode(self, latents: torch.Tensor, keep: slice, last: bool):
        if self.decoder is None:
            self.decoder = self.open_decoder(latents)
        pixels = self.decoder.decode(latents, keep)
        if last:
            self.decoder.close()                       # the next run decodes on its own
            self.decoder = None
        return pixels

    def _count(self, max_frames: int) -> int:
        """Latent frames to decode now: the first piece, whole; else the most whose frames fit in `max_frames`, at
        least one frame handed out, never past the end of a run."""
        p, done, start = self.policy, self.latents_done, self.frames_out
        if p.whole:
            return self.pieces[0][0].shape[2]
        available = sum(x.shape[2] for x, _ in self.pieces)
        if p.run:
            available = min(available, p.run - done % p.run)
        k = 1
        while k < available and p.out(done + k, self.limit) <= start:            # frames that are all skipped
            k += 1
        while k < available and p.out(done + k + 1, self.limit) - start <= max_frames:
            k += 1
        return k

    def _take(self, k: int) -> tuple[torch.Tensor, LiveChunkInfo | None]:
        """The first `k` pushed latent frames (B, C, k, h, w), out of the stream, and the first piece's chunk."""
        parts, live = [], self.pieces[0][1]
        while k:
            x, piece_live = self.pieces[0]
            n = min(k, x.shape[2])
            parts.append(x[:, :, :n])
            if n == x.shape[2]:
                self.pieces.popleft()
            else:
                self.pieces[0] = (x[:, :, n:], piece_live)
            k -= n
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)), live

    def _latents(self):
        """Output "latent": a live chunk at a time, else every pushed frame in one piece."""
        if self.policy.whole:
            latents, self.live = self._take(self.pieces[0][0].shape[2])
            self.latents_done += latents.shape[2]
            self.frames_out = self.policy.out(self.latents_done, self.limit)
        else:
            latents = torch.cat([x for x, _ in self.pieces], dim=2) if len(self.pieces) > 1 else self.pieces[0][0]
            self.pieces.clear()
            self.frames_out = self.limit
        return latents.cpu() if self.rank == 0 else None


class WanVAEDecoder:
    """A Wan VAE (`AutoencoderKLWan`) path: one request's normalised latents, in time order, decoded across the
    workers by engine/causal_vae.py's `StreamingVAEDecoder` (carrying the causal cache between calls), untiled as
    diffusers' Wan pipelines decode or in diffusers' default tiles (`vae.enable_tiling()`) with `tiling`; split "rows":
    every frame's rows across the workers (engine/vae_split.py's `RowSplitWanDecoder`; a frame with fewer latent rows
    than workers falls back to the item split). With `slots` (engine/live_frames.py), rank 0's frames go out as uint8
    made on the device, in a shared-memory slot."""

    def __init__(self, pipe, pg, latents: torch.Tensor, tiling: bool, output: str, split: str = "items", slots=None):
        from longserve.engine.causal_vae import StreamingVAEDecoder, VAETiling
        from longserve.engine.vae_split import RowSplitWanDecoder, split_rows_fits

        B, _, _, h, w = latents.shape
        self.vae, self.processor, self.output, self.slots = pipe.vae, pipe.video_processor, output, slots
        if split == "rows" and not tiling and split_rows_fits(h, pg.world_size):
            self.stream = RowSplitWanDecoder(pipe.vae, pg, B, h, w)
        else:
            self.stream = StreamingVAEDecoder(pipe.vae, pg, B, h, w, tiling=VAETiling() if tiling else None)

    def decode(self, latents: torch.Tensor, keep: slice):
        with torch.no_grad():
            video = self.stream.decode(unnormalize(self.vae, latents))          # (B, 3, n, H, W) on rank 0
        if video is None:
            return None
        if self.slots is not None:
            from longserve.engine.live_frames import to_uint8

            return self.slots.put(to_uint8(video[:, :, keep]))
        return to_pixels(video[:, :, keep], self.processor, self.output)

    def close(self) -> None:
        self.stream.close()


def unnormalize(vae, latents: torch.Tensor) -> torch.Tensor:
    """The Wan pipelines' `latents / (1 / std) + mean`, in the VAE's dtype."""
    z = vae.config.z_dim
    latents = latents.to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    return latents / inv_std + mean


def to_pixels(video: torch.Tensor, video_processor, output: str):
    """Decoded (B, 3, n, H, W) in [-1, 1] -> float32 (B, n, H, W, 3) in [0, 1] (diffusers' "np"), or uint8."""
    frames = video_processor.postprocess_video(video=video.float().cpu(), output_type="np")
    if output == "uint8":
        return (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
    return frames
