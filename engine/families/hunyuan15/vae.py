"""HunyuanVideo-1.5's VAE decode, streamed in time: a request's latent frames in consecutive chunks, each decoded to
its pixel frames as it comes, in memory bounded by the chunk (not the clip) plus small caches.

diffusers' `AutoencoderKLHunyuanVideo15` decoder is causal in time, in three places, and per pixel frame elsewhere
(its RMS norms normalise each position over channels; the activations and 1x1 convolutions are per position):

    HunyuanVideo15CausalConv3d   kernel kt in time, padded with kt - 1 copies of the first frame ("replicate")
                                 before it: an output frame reads its own input frame and the kt - 1 before it
    HunyuanVideo15AttnBlock      (mid block, latent resolution) every token attends to the tokens of its own
                                 frame and of every earlier frame (`prepare_causal_attention_mask`)
    HunyuanVideo15Upsample       2x in time, but the clip's first frame becomes one frame (and takes half the
                                 channels of the shortcut): 1 + 2(k - 1) frames of k

So a chunk decodes exactly as the one-shot `vae.decode` when it carries, per causal convolution, its last kt - 1
input frames (the first chunk pads with copies of its first frame, as diffusers does), per attention block, the
keys and values of every earlier latent frame (at latent resolution: C x h x w values a frame), and, per upsampler,
whether the chunk starts the clip. `HunyuanVAEStream.decode(z)` walks the decoder's modules in diffusers' order
(`HunyuanVideo15Decoder3D.forward`) with those three rules; its outputs concatenated are diffusers' decode
(tests/engine/test_hunyuan15_vae.py checks it on tiny-hunyuan15's VAE). The first chunk of k latent frames makes
1 + 4(k - 1) frames, every later one 4k (`engine.decoding.decoded_frames`).

diffusers' spatial tiling (`vae_tiling`) decodes each tile over the whole clip and blends the tiles; it is not
streamed: with tiling the family decodes the clip whole, as diffusers does. The decode runs on rank 0 (a batch's
videos one after the other would split across ranks as the Wan decoder splits its items; not done here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longserve.engine.decoding import to_pixels
from longserve.engine.families.composed import Decoder
from longserve.engine.request import GenerationSpec


class HunyuanVAEStream:
    """One clip's decode, chunk by chunk in time order, on the caller's device."""

    def __init__(self, vae, rows=None):
        self.vae, self.rows = vae, rows                            # rows: a RowSplit, or None for whole frames
        self.decoder = vae.decoder
        self.convs: dict[int, torch.Tensor] = {}                   # id(causal conv) -> its last kt - 1 input frames
        self.attns: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(attn block) -> keys, values so far
        self.latent_frames = 0                                     # latent frames decoded so far

    def close(self) -> None:
        self.convs.clear()
        self.attns.clear()

    def cache_bytes(self) -> int:
        tensors = [*self.convs.values(), *(t for kv in self.attns.values() for t in kv)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """The next latent frames z (B, C, k, h, w), already divided by the scaling factor -> their pixel frames
        (B, 3, n, H, W), n = 1 + 4(k - 1) for the clip's first chunk, else 4k. With `rows`: z is the whole frame on
        every rank and the result is rows.dst's, gathered (None elsewhere)."""
        d, first = self.decoder, self.latent_frames == 0
        z = z.to(self.vae.dtype)
        if self.rows is not None:
            z = self.rows.take(z)                                  # (B, C, k, band, w)
        h = self._conv(d.conv_in, z) + z.repeat_interleave(repeats=d.repeat, dim=1)
        h = self._mid(d.mid_block, h)
        for up in d.up_blocks:
            for resnet in up.resnets:
                h = self._resnet(resnet, h)
            for upsampler in up.upsamplers or ():
                h = self._upsample(upsampler, h, first)
        h = self._conv(d.conv_out, d.conv_act(d.norm_out(h)))
        self.latent_frames += z.shape[2]
        return h if self.rows is None else self.rows.gather_to_dst(h)

    # -- the three causal rules; the rest as diffusers' modules compute it -------------------------------------

    def _conv(self, m, x: torch.Tensor) -> torch.Tensor:
        """`HunyuanVideo15CausalConv3d` on the next frames of x (B, C, f, H, W), with the frames before them."""
        kt = m.conv.kernel_size[0]
        if kt > 1:
            past = self.convs.get(id(m))
            if past is None:                       # the clip's start: what diffusers' time padding puts there
                past = x[:, :, :1].expand(-1, -1, kt - 1, -1, -1)
                if m.pad_mode != "replicate":
                    past = torch.zeros_like(past)
            x = torch.cat([past, x], dim=2)
            self.convs[id(m)] = x[:, :, -(kt - 1):].clone()
        w0, w1, h0, h1 = m.time_causal_padding[:4]
        if self.rows is not None and h0 == h1:
            x = self.rows.pad_rows(x, h0, "constant" if m.pad_mode == "zeros" else m.pad_mode)  # the halo
            h0 = h1 = 0
        return m.conv(F.pad(x, (w0, w1, h0, h1, 0, 0), mode=m.pad_mode))

    def _resnet(self, m, x: torch.Tensor) -> torch.Tensor:
        h = self._conv(m.conv1, m.nonlinearity(m.norm1(x)))
        h = self._conv(m.conv2, m.nonlinearity(m.norm2(h)))
        return h + (m.conv_shortcut(x) if m.conv_shortcut is not None else x)

    def _mid(self, m, x: torch.Tensor) -> torch.Tensor:
        x = self._resnet(m.resnets[0], x)
        for attn, resnet in zip(m.attentions, m.resnets[1:]):
            if attn is not None:
                x = self._attn(attn, x)
            x = self._resnet(resnet, x)
        return x

    def _attn(self, m, x: torch.Tensor) -> torch.Tensor:
        """`HunyuanVideo15AttnBlock`: my frames' tokens against every earlier frame's and their own frame's (the whole
        frame's: a band gathers the frame's rows first and keeps its own after)."""
        if self.rows is not None:
            return self.rows.own_rows(self._attn_frame(m, self.rows.gather_rows(x)))
        return self._attn_frame(m, x)

    def _attn_frame(self, m, x: torch.Tensor) -> torch.Tensor:
        B, C, f, H, W = x.shape
        n = H * W
        y = m.norm(x)
        q, k, v = (proj(y).reshape(B, C, f * n).transpose(1, 2).unsqueeze(1) for proj in (m.to_q, m.to_k, m.to_v))
        past = self.attns.get(id(m))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)        # (B, 1, P + f n, C)
        self.attns[id(m)] = (k, v)
        P = k.shape[2] - f * n
        frame = torch.arange(f * n, device=x.device) // n                              # each query's frame
        visible = torch.arange(P + f * n, device=x.device)[None, :] < (P + (frame[:, None] + 1) * n)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)               # (B, 1, f n, C)
        out = out.squeeze(1).reshape(B, f, H, W, C).permute(0, 4, 1, 2, 3)
        return m.proj_out(out) + x

    def _upsample(self, m, x: torch.Tensor, first: bool) -> torch.Tensor:
        """`HunyuanVideo15Upsample`: the clip's first frame (in the first chunk only) as diffusers treats it."""
        up = m._dcae_upsample_rearrange
        h = self._conv(m.conv, x)
        if not m.add_temporal_upsample:
            return up(h, r1=1, r2=2, r3=2) + up(x.repeat_interleave(repeats=m.repeats, dim=1), r1=1, r2=2, r3=2)
        parts, shortcut = [], []
        if first:
            h_first = up(h[:, :, :1], r1=1, r2=2, r3=2)
            parts.append(h_first[:, : h_first.shape[1] // 2])
            shortcut.append(up(x[:, :, :1], r1=1, r2=2, r3=2).repeat_interleave(repeats=m.repeats // 2, dim=1))
            h, x = h[:, :, 1:], x[:, :, 1:]
        parts.append(up(h, r1=2, r2=2, r3=2))
        shortcut.append(up(x, r1=2, r2=2, r3=2).repeat_interleave(repeats=m.repeats, dim=1))
        return torch.cat(parts, dim=2) + torch.cat(shortcut, dim=2)


class Hunyuan15Decoder:
    """The HunyuanVideo-1.5 VAE on rank 0: streamed in time, a chunk of latent frames at a time as the frame stream
    hands them (`HunyuanVAEStream`: the decoder is causal in time, so the chunks' frames are diffusers' decode);
    with `vae_tiling`, the clip whole through diffusers' tiled decode, as the pipeline does; with `rows`, streamed on
    every rank, each its band of the frame's rows (engine/vae_split.py), gathered on rank 0."""

    def __init__(self, pipe, pg, tiling: bool, output: str, rows_of: int | None = None):
        """rows_of: the latent height whose rows split across the workers (None: rank 0 decodes whole frames)."""
        from longserve.engine.vae_split import RowSplit

        self.pipe, self.pg, self.output, self.tiling = pipe, pg, output, tiling
        self.rows = rows_of is not None and not tiling
        if tiling:
            pipe.vae.enable_tiling()
        else:
            pipe.vae.disable_tiling()
        self.stream = None
        if self.rows:
            self.stream = HunyuanVAEStream(pipe.vae, RowSplit(pg, rows_of))
        elif pg.rank == 0 and not tiling:
            self.stream = HunyuanVAEStream(pipe.vae)

    def decode(self, latents: torch.Tensor, keep: slice):
        vae = self.pipe.vae
        if self.rows:
            video = self.stream.decode(latents.to(vae.dtype) / vae.config.scaling_factor)  # (B, 3, n, H, W) on 0
            return None if video is None else to_pixels(video[:, :, keep], self.pipe.video_processor, self.output)
        if self.pg.rank != 0:
            return None
        z = latents.to(vae.dtype) / vae.config.scaling_factor
        if self.stream is not None:
            video = self.stream.decode(z)                                        # (B, 3, n, H, W)
        else:
            with torch.no_grad():
                video = vae.decode(z, return_dict=False)[0]
        return to_pixels(video[:, :, keep], self.pipe.video_processor, self.output)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


class Hunyuan15VAE(Decoder):
    """The decoder part: a request's run of final latents -> its `Hunyuan15Decoder` (the rows split across the
    workers when `vae_split` is "rows" and the latent height covers them)."""

    def __call__(self, spec: GenerationSpec, latents: torch.Tensor) -> Hunyuan15Decoder:
        from longserve.engine.vae_split import split_rows_fits

        w = self.w
        rows = w.vae_split == "rows" and w.pg.world_size > 1 and split_rows_fits(latents.shape[3], w.pg.world_size)
        return Hunyuan15Decoder(w.pipe, w.pg, w.vae_tiling, spec.output, rows_of=latents.shape[3] if rows else None)
