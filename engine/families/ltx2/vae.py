"""LTX-2's video VAE decode, windowed in time: a clip's latent frames decoded a window at a time, each window with a
halo of H latent frames on either side, keeping the window's own pixel frames, which equal diffusers' one-call
`vae.decode` of the whole clip.

diffusers' `AutoencoderKLLTX2Video` decoder (`LTX2VideoDecoder3d`) is not causal in time (`decoder_causal` false in
the published config): every `LTX2VideoCausalConv3d` then reads (kt - 1) // 2 frames on each side, padded at the
clip's two ends with copies of its first and last frame ("replicate"). Everything else is local in time:

    PerChannelRMSNorm, the shortcut's LayerNorm   per position, over channels
    activations, 1x1x1 shortcut convolutions      per position
    LTX2VideoUpsampler3d                          its convolution (as above), then depth-to-space: 2x in time,
                                                  dropping the first stride - 1 frames; the residual the same way
    timestep conditioning                         one timestep per clip (zero, as the pipeline decodes): the same
                                                  scale and shift for every frame, whatever the window
    the mid block                                 resnets only (no attention)

So an output frame depends on the latent frames within a fixed radius, H, and a window [s, e) of the clip decodes
the frames of its latent frames [s + H, e - H) exactly as the whole clip does; where the window starts or ends at
the clip's own start or end, diffusers' replicate padding sees the same frame it sees in the whole decode, so no
halo is needed there. `halos(decoder)` derives H, before and after, from the modules (`temporal_ops`: every
temporal kernel radius, divided by the temporal upsampling already done before it, with the depth-to-space's
rounding, computed exactly on frame indices): 7 and 7 on tiny-ltx2, 22 and 22 at the published shape (a causal
decoder, `decoder_causal` true, reads only before: 44 and 0 there); tests/engine/test_ltx2_vae.py checks it by
perturbing one latent frame.

Frame indices: a window of n latent frames makes 1 + 8(n - 1) frames (three upsamplers, each dropping its first
frame); the window starting at latent frame s > 0 starts at the whole clip's frame 8s (latent frame s's last
frame), so latent frames [a, b) are the clip's frames [0 if a == 0 else 8a - 7, 8(b - 1) + 1).

Across workers (`rows`, engine/vae_split.py's `RowSplit`): every rank decodes its band of each frame's rows through
diffusers' own decoder, each convolution reading its neighbours' edge rows (`row_split_hooks`); the decoder has no
attention, so nothing else crosses a band; rank `rows.dst` gathers the bands.

Not streamed (`not_streamable` says why; the family then decodes the clip whole): noise injection
(`decoder_inject_noise`: a fresh random draw per decode call), diffusers' spatial tiling or frame-wise decoding
(enabled on the VAE: its own temporal tiles blend over the clip).

The family's decoder part (`LTX2VAE`) hands a clip out window by window: a window keeps 2H latent frames, whatever
`decode_chunk_frames` (the last one the rest); a clip no longer than a window plus its two halos is decoded whole, in
one call, as diffusers does, and so is every clip where the VAE cannot be windowed. The sound: the audio latents
through the audio VAE and the vocoder, decoded before the first video window and handed out with it
(`FramesChunk.audio`, an `engine.outputs.Sound`: float32 (B, channels, samples) at the vocoder's rate), so a
streamed download knows the sound when it writes the first frames. A request with `audio: false` skips the audio
decode (its latents are still denoised: the two streams are one model).
"""

from __future__ import annotations

import numpy as np
import torch

from longserve.engine.families.composed import Decoder
from longserve.engine.outputs import Sound


def temporal_ops(decoder) -> list[tuple]:
    """The decoder's operations on the time axis, in forward order: ("conv", left, right) reads `left` frames before
    and `right` after at its own frame rate; ("up", stride) makes `stride` frames of each and drops the first
    stride - 1. The per-position parts (norms, activations, 1x1x1 shortcuts) are left out."""
    from diffusers.models.autoencoders.autoencoder_kl_ltx2 import LTX2VideoCausalConv3d, LTX2VideoUpsampler3d

    causal = bool(decoder.is_causal)

    def conv(m):
        span = (m.kernel_size[0] - 1) * m.conv.dilation[0]
        return ("conv", span, 0) if causal else ("conv", span // 2, span // 2)

    ops, inside = [], set()
    # registration order is LTX2VideoDecoder3d's forward order: conv_in, the mid block, each up block (its conv_in
    # resnet, its upsampler, its resnets), conv_out; an upsampler is listed before its own convolution, which runs
    # before its depth-to-space
    for m in decoder.modules():
        if isinstance(m, LTX2VideoUpsampler3d):
            ops += [conv(m.conv), ("up", m.stride[0])]
            inside.add(id(m.conv))
        elif isinstance(m, LTX2VideoCausalConv3d) and id(m) not in inside:
            ops.append(conv(m))
    return ops


def _inputs_of(ops: list[tuple], lo: int, hi: int) -> tuple[int, int]:
    """The latent frames [lo', hi'] (inclusive) that output frames [lo, hi] of an endless clip read."""
    for op in reversed(ops):
        if op[0] == "conv":
            lo, hi = lo - op[1], hi + op[2]
        else:                                 # output frame o is frame (o + stride - 1) // stride of the input
            st = op[1]
            lo, hi = (lo + st - 1) // st, (hi + st - 1) // st
    return lo, hi


def halos(decoder) -> tuple[int, int]:
    """(left, right): the latent frames before and after a latent frame that its output frames read (its receptive
    field in time); left at least 1 (a window starting past the clip's start needs the frame before it: see the
    module's doc). A causal decoder (`decoder_causal`) reads none after."""
    ops = temporal_ops(decoder)
    t = 1
    for op in ops:
        if op[0] == "up":
            t *= op[1]
    j = 1000                                  # a latent frame far from both ends: frames [t j - t + 1, t j]
    lo, hi = _inputs_of(ops, t * j - t + 1, t * j)
    return max(1, j - lo), hi - j


def halo(decoder) -> int:
    """H: the larger of `halos`."""
    return max(halos(decoder))


def not_streamable(vae) -> str | None:
    """Why a windowed decode would not equal the one-call decode with this VAE (None: it does)."""
    if any(getattr(r, "per_channel_scale1", None) is not None for r in vae.decoder.modules()):
        return "the decoder injects noise (decoder_inject_noise): each decode call draws its own"
    if getattr(vae, "use_tiling", False) or getattr(vae, "use_framewise_decoding", False):
        return "diffusers' tiled / frame-wise decode is on (it blends its own tiles over the clip)"
    return None


class LTX2WindowedDecode:
    """One clip's decode, a window of latent frames at a time (any order, any cut): `decode(a, b)` -> the pixel frames
    of latent frames [a, b), as the one-call `vae.decode(z, timestep)` makes them."""

    def __init__(self, vae, z: torch.Tensor, timestep: torch.Tensor | None = None,
                 halo_frames: tuple[int, int] | None = None, rows=None):
        self.vae, self.z, self.timestep, self.rows = vae, z, timestep, rows
        self.left, self.right = halos(vae.decoder) if halo_frames is None else halo_frames
        self.t = vae.temporal_compression_ratio
        self.decoded_latent_frames = 0         # latent frames decoded, halos included (the cost)

    @torch.no_grad()
    def decode(self, a: int, b: int) -> torch.Tensor:
        """(B, 3, n, H, W): the clip's frames of latent frames [a, b), n = 1 + t(b - a - 1) if a == 0 else t(b - a);
        with `rows`, on rows.dst (None elsewhere)."""
        F, t = self.z.shape[2], self.t
        s, e = max(0, a - self.left), min(F, b + self.right)
        self.decoded_latent_frames += e - s
        first = 0 if a == 0 else t * a - t + 1           # the clip's frame numbers; the window starts at t s
        if self.rows is None:
            video = self.vae.decode(self.z[:, :, s:e], self.timestep, return_dict=False)[0]
            return video[:, :, first - t * s: t * (b - 1) + 1 - t * s]
        from longserve.engine.vae_split import row_split_hooks

        with row_split_hooks(self.vae.decoder, self.rows):
            band = self.vae.decode(self.rows.take(self.z[:, :, s:e]), self.timestep, return_dict=False)[0]
        return self.rows.gather_to_dst(band[:, :, first - t * s: t * (b - 1) + 1 - t * s])


class LTX2VAE(Decoder):
    """The decoder part: the video VAE windowed in time and the sound (audio VAE, vocoder), all in float32."""

    dtypes = {"vae": torch.float32, "audio_vae": torch.float32, "vocoder": torch.float32}

    def __init__(self, worker):
        super().__init__(worker)
        self.halos = halos(worker.pipe.vae.decoder)          # (before, after): latent frames a window reads
        self.refused = not_streamable(worker.pipe.vae)        # why the clip is decoded whole, or None

    def clip(self, r) -> "LTX2Decoder":
        return LTX2Decoder(self, r)

    def frames_per_call(self, r, max_frames: int) -> int:
        """The frames a decode call hands out (`FrameStream.next`'s max_frames), whatever the scheduler's: a window
        of 2H latent frames (fewer would decode more halo than frames; more would hand out the first frames later),
        the last window taking the rest (less than two windows); the whole clip in one call when it is no longer
        than a window and its two halos (4H latent frames), or the VAE cannot be windowed."""
        before, after = self.halos
        window = before + after                                       # latent frames kept per call
        if r.spec.output == "latent" or self.refused or r.latent_frames <= 2 * window:
            return r.num_frames                                       # the whole clip, one call
        if r.latent_frames - r.frames.latents_done < 2 * window:
            return r.num_frames                                       # the rest: no window shorter than the others
        return window * self.w.pipe.vae_temporal_compression_ratio

    def sound(self, r) -> np.ndarray:
        """The request's sound: the audio VAE's mel spectrogram through the vocoder -> float32 (B, channels, n)."""
        pipe = self.w.pipe
        latents = self.w.loop.final_audio_latents(r).to(pipe.audio_vae.dtype)
        mel = pipe.audio_vae.decode(latents, return_dict=False)[0]
        return pipe.vocoder(mel).float().cpu().numpy()


class LTX2Decoder:
    """A clip's decode on rank 0, a window of latent frames at a time as the frame stream hands them
    (`LTX2WindowedDecode`: each with its halo from the whole clip's latents; one window of the whole clip is
    diffusers' one call), and the sound with the first window, decoded before it."""

    def __init__(self, vae: LTX2VAE, r):
        self.vae, self.r = vae, r
        self.window = None
        self.start = 0                      # the clip's latent frames handed out so far

    def decode(self, latents: torch.Tensor, keep: slice):
        w = self.vae.w
        rows = w.vae_split == "rows" and w.pg.world_size > 1     # every rank decodes its band of the rows
        if w.pg.rank != 0 and not rows:
            return None
        from longserve.engine.decoding import to_pixels
        from longserve.engine.vae_split import RowSplit, split_rows_fits

        pipe, r = w.pipe, self.r
        with torch.no_grad():
            if self.start == 0 and r.spec.options.get("audio", True) and w.pg.rank == 0:   # the sound first
                r.frames.audio = Sound(self.vae.sound(r), w.desc.facts.audio_rate)
            if self.window is None:
                clip = r.clip.to(pipe.vae.dtype)
                timestep = None
                if pipe.vae.config.timestep_conditioning:
                    timestep = torch.zeros(clip.shape[0], device=clip.device, dtype=clip.dtype)
                split = RowSplit(w.pg, clip.shape[3]) if rows and split_rows_fits(clip.shape[3],
                                                                                   w.pg.world_size) else None
                if w.pg.rank != 0 and split is None:
                    self.start += latents.shape[2]
                    return None
                self.window = LTX2WindowedDecode(pipe.vae, clip, timestep, self.vae.halos, rows=split)
            a = self.start
            self.start += latents.shape[2]
            video = self.window.decode(a, self.start)
        return None if video is None else to_pixels(video[:, :, keep], pipe.video_processor, r.spec.output)

    def close(self) -> None:
        self.window, self.r.clip = None, None          # the clip is handed out: its latents are not kept
