"""The VAE decode split across workers by rows of the frame: every worker decodes its band of every frame, exact to
the one-worker untiled decode, and the bands are gathered on one rank.

Why rows, not today's work items (engine/causal_vae.py): an untiled video is one item, so one worker decodes it and
the others wait; diffusers' tiles spread over workers but each tile redoes its overlap and the blend is not the
untiled decode. A band of rows with its neighbours' edge rows is the untiled decode, cut.

What a video VAE's decoder does to rows (Wan 2.1/2.2, HunyuanVideo-1.5, LTX-2 alike):

    3x3(x3) convolutions         read one row above and below (`p` = kernel // 2 rows): a band needs its
                                 neighbours' edge rows, the *halo*, before every such convolution; at the frame's
                                 own top and bottom the convolution's own padding (zeros, replicate, reflect)
    norms, activations, 1x1      per position (Wan's and LTX-2's RMS norms normalise over channels)
    upsampling                   nearest-exact 2x or depth-to-space: output rows 2i, 2i + 1 read input row i, so a
                                 band of latent rows [a, b) is the band [s a, s b) at every scale s
    mid-block attention          (Wan, HunyuanVideo-1.5) every position of a frame attends to the whole frame: the
                                 band all-gathers the frame's rows at latent resolution, attends, keeps its own rows

So each worker runs the library's own decoder modules on its band, with a halo exchange per convolution (one
all-gather of every band's top and bottom `p` rows: a few rows, whatever the frame) and one all-gather per attention;
the causal-in-time caches stay what they are, per convolution, now of the band's rows (a convolution's cache holds its
input's last frames, band rows only; the halo is exchanged after the cached frames are put in front, so the halo
carries the neighbours' cached frames too). A band that recomputed a wider halo instead would not need the exchange,
but Wan's and HunyuanVideo-1.5's attention makes the receptive field the whole frame: it could not be exact.

`RowSplit` is one worker's band and its collectives; `row_split_hooks(decoder, rows)` runs diffusers' Wan and LTX-2
decoder modules on bands (their convolutions' `forward`s wrapped for the call's duration, nothing else changed);
families/hunyuan15/vae.py's stream takes a `RowSplit` in its own convolution and attention rules; `RowSplitWanDecoder`
is the Wan family's streamed decode on bands. Every rank must run the same decode in the same order (each
convolution is a collective). Bands are as even as latent rows allow (the first ranks one row more); a frame with
fewer latent rows than workers is refused (`split_rows_fits`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from longserve.engine import comm
from longserve.engine.dist import ParallelGroup


def row_bands(height: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) latent rows of each of `parts` bands of `height` rows, the first `height % parts` one longer."""
    if parts < 1 or height < parts:
        raise ValueError(f"cannot split {height} latent rows into {parts} bands of at least one row")
    base, extra = divmod(height, parts)
    bands, start = [], 0
    for r in range(parts):
        stop = start + base + (r < extra)
        bands.append((start, stop))
        start = stop
    return bands


def split_rows_fits(latent_height: int, workers: int) -> bool:
    """Can a frame of `latent_height` rows be split into one band per worker?"""
    return workers >= 1 and latent_height >= workers


class RowSplit:
    """This rank's band of every frame's rows, and the collectives that make a decode on bands the whole decode."""

    def __init__(self, pg: ParallelGroup, latent_height: int, dst: int = 0):
        if not isinstance(dst, int) or not 0 <= dst < pg.world_size:
            raise ValueError(f"dst must be a rank of the group, 0..{pg.world_size - 1}; got {dst!r}")
        self.pg, self.dst = pg, dst
        self.bands = row_bands(latent_height, pg.world_size)
        self.latent_height = latent_height
        self.start, self.stop = self.bands[pg.rank]
        self.top, self.bottom = pg.rank == 0, pg.rank == pg.world_size - 1

    def take(self, z: torch.Tensor) -> torch.Tensor:
        """This rank's latent rows of z (..., h, w) -> (..., band, w)."""
        return z[..., self.start:self.stop, :]

    def _scale(self, x: torch.Tensor) -> int:
        """Rows per latent row at x's resolution (x holds this rank's band)."""
        rows = self.stop - self.start
        if x.shape[-2] % rows:
            raise RuntimeError(f"a band of {rows} latent rows cannot be {x.shape[-2]} rows at any scale")
        return x.shape[-2] // rows

    def pad_rows(self, x: torch.Tensor, p: int, mode: str = "constant") -> torch.Tensor:
        """x (..., rows, W) -> (..., p + rows + p, W): the neighbours' `p` edge rows inside the frame, the
        convolution's own padding (`mode`, as F.pad names it) at the frame's top and bottom. Collective."""
        if p == 0:
            return x
        if self.pg.world_size > 1:
            if x.shape[-2] < p:
                raise RuntimeError(f"a band of {x.shape[-2]} rows cannot lend a halo of {p}")
            edges = torch.cat([x[..., :p, :], x[..., -p:, :]], dim=-2)          # (..., 2p, W): my top, my bottom
            every = comm.all_gather(edges, -2, self.pg)                          # (..., N 2p, W)
            r = self.pg.rank
            above = None if self.top else every[..., (2 * r - 1) * p:2 * r * p, :]        # rank r-1's bottom
            below = None if self.bottom else every[..., (2 * r + 2) * p:(2 * r + 3) * p, :]  # rank r+1's top
            x = torch.cat([t for t in (above, x, below) if t is not None], dim=-2)
        top, bottom = p if self.top else 0, p if self.bottom else 0
        if top or bottom:
            # F.pad pads non-constant modes over the last 2 (4-D) or 3 (5-D) dimensions: name them all
            pad = [0, 0, top, bottom] + ([0, 0] if x.ndim == 5 else [])
            x = F.pad(x, pad, mode=mode)
        return x

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every band of x (..., rows, W) -> the whole frame (..., H, W) on every rank. Collective."""
        if self.pg.world_size == 1:
            return x
        s = self._scale(x)
        most = s * max(b - a for a, b in self.bands)
        every = comm.all_gather(comm.pad_dim(x, -2, most), -2, self.pg)           # (..., N most, W)
        return torch.cat([every[..., r * most:r * most + s * (b - a), :] for r, (a, b) in enumerate(self.bands)],
                         dim=-2)

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The whole frame x (..., H, W) -> this rank's band (..., rows, W)."""
        s = x.shape[-2] // self.latent_height
        return x[..., s * self.start:s * self.stop, :]

    def gather_to_dst(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every band of x (..., rows, W) -> the whole frame (..., H, W) on rank `dst`, None elsewhere. Collective."""
        if self.pg.world_size == 1:
            return x
        s = self._scale(x)
        most = s * max(b - a for a, b in self.bands)
        every = comm.gather_to(comm.pad_dim(x, -2, most).contiguous(), self.dst, self.pg)   # (N, ..., most, W)
        if every is None:
            return None
        return torch.cat([every[r][..., :s * (b - a), :] for r, (a, b) in enumerate(self.bands)], dim=-2)


# -- diffusers' decoder modules on bands ---------------------------------------------------------------------------


def _wan_causal_conv(m, rows: RowSplit, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """`WanCausalConv3d.forward` on a band: the cached frames in front, then the halo, then zeros in time and width."""
    w0, w1, h0, h1, t0, t1 = m._padding
    if cache_x is not None and t0 > 0:
        x = torch.cat([cache_x.to(x.device), x], dim=2)
        t0 -= cache_x.shape[2]
    x = rows.pad_rows(x, h0)                                                     # (B, C, T, p + rows + p, W)
    x = F.pad(x, (w0, w1, 0, 0, t0, t1))
    return nn.Conv3d.forward(m, x)


def _conv_on_band(m, rows: RowSplit, x: torch.Tensor) -> torch.Tensor:
    """A stride-1 nn.Conv2d / nn.Conv3d with symmetric padding, on a band: its padding mode at the frame's edges."""
    p = m.padding[-2]
    mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
    x = rows.pad_rows(x, p, mode)
    pw = m.padding[-1]
    if pw:
        x = F.pad(x, (pw, pw, 0, 0, 0, 0)[:2 * (x.ndim - 2)], mode=mode)
    padding = (*m.padding[:-2], 0, 0)
    conv = F.conv3d if isinstance(m, nn.Conv3d) else F.conv2d
    return conv(x, m.weight, m.bias, m.stride, padding, m.dilation, m.groups)


def _attention_on_band(forward, rows: RowSplit, x: torch.Tensor) -> torch.Tensor:
    """A frame-global attention block: the whole frame's rows in, this band's rows out."""
    return rows.own_rows(forward(rows.gather_rows(x)))


def _wan_parts():
    from diffusers.models.autoencoders import autoencoder_kl_wan as wan

    plain = (wan.WanDecoder3d, wan.WanMidBlock, wan.WanResidualBlock, wan.WanRMS_norm, wan.WanUpBlock,
             wan.WanResample, wan.WanUpsample, nn.Sequential, nn.ModuleList, nn.SiLU, nn.Dropout, nn.Identity)
    plain += tuple(getattr(wan, name) for name in ("WanResidualUpBlock", "DupUp3D") if hasattr(wan, name))
    return wan, plain


def _ltx2_parts():
    from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2

    return ltx2


@contextlib.contextmanager
def row_split_hooks(decoder: nn.Module, rows: RowSplit):
    """For the block's duration, `decoder` (diffusers' Wan or LTX-2 video decoder) runs on `rows`' band: every
    convolution that reads neighbouring rows exchanges its halo, Wan's attention gathers the frame. A Wan decoder
    holding a module whose effect on rows is not known here is refused rather than decoded wrong."""
    patched = []
    wan, wan_plain = _wan_parts()
    if isinstance(decoder, wan.WanDecoder3d):
        attention = [name for name, m in decoder.named_modules() if isinstance(m, wan.WanAttentionBlock)]
        for name, m in decoder.named_modules():
            if any(name.startswith(a + ".") for a in attention):
                continue                            # runs inside its block's forward, on the gathered frame
            if isinstance(m, wan.WanCausalConv3d):
                patched.append((m, functools.partial(_wan_causal_conv, m, rows)))
            elif isinstance(m, wan.WanAttentionBlock):
                patched.append((m, functools.partial(_attention_on_band, m.forward, rows)))
            elif isinstance(m, nn.Conv2d):
                if m.stride != (1, 1) or m.padding[0] != m.padding[1]:
                    raise ValueError(f"cannot split the Wan decoder by rows: {name} is a strided or asymmetric conv")
                patched.append((m, functools.partial(_conv_on_band, m, rows)))
            elif not isinstance(m, wan_plain):
                raise ValueError(f"cannot split the Wan decoder by rows: {name} ({type(m).__name__}) is not known "
                                 "to act on rows locally")
    else:
        ltx2 = _ltx2_parts()
        if not isinstance(decoder, ltx2.LTX2VideoDecoder3d):
            raise ValueError(f"no row split for {type(decoder).__name__} (Wan and LTX-2 video decoders)")
        for name, m in decoder.named_modules():
            if isinstance(m, ltx2.LTX2VideoCausalConv3d):
                c = m.conv
                if c.stride[1] != 1 or c.padding_mode == "circular":
                    raise ValueError(f"cannot split the LTX-2 decoder by rows: {name} is strided or circular")
                patched.append((c, functools.partial(_conv_on_band, c, rows)))
    try:
        for m, forward in patched:
            m.forward = forward                     # an instance attribute: module.__call__ finds it first
        yield
    finally:
        for m, _ in patched:
            m.__dict__.pop("forward", None)


# -- the Wan family's streamed decode on bands ---------------------------------------------------------------------


class RowSplitWanDecoder:
    """Decode Wan latents chunk by chunk in time, each frame's rows split across the ranks of `pg`, gathered on `dst`.

    The same contract as engine/causal_vae.py's `StreamingVAEDecoder` untiled (the chunks' outputs concatenated are
    diffusers' `vae.decode(z).sample` of each video, within float rounding: a convolution over a band rounds as the
    one over the frame does, but BLAS may block them differently), with every rank decoding every video's band: the
    decode's work, activations and caches are split N ways, where the item split leaves a lone video to one rank.
    Between calls a rank holds its band's causal caches, per video."""

    def __init__(self, vae, pg: ParallelGroup, batch_size: int, latent_height: int, latent_width: int, dst: int = 0):
        from diffusers import AutoencoderKLWan

        if not isinstance(vae, AutoencoderKLWan):
            raise ValueError(f"vae must be diffusers' AutoencoderKLWan, got {type(vae).__name__}")
        for name, value in (("batch_size", batch_size), ("latent_height", latent_height),
                            ("latent_width", latent_width)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.vae, self.pg, self.dst = vae, pg, dst
        self.batch_size, self.latent_height, self.latent_width = batch_size, latent_height, latent_width
        self.rows = RowSplit(pg, latent_height, dst)
        param = next(vae.parameters())
        self.dtype, self.device = param.dtype, param.device
        wan, _ = _wan_parts()
        convs = sum(isinstance(m, wan.WanCausalConv3d) for m in vae.decoder.modules())
        self._caches = [[None] * convs for _ in range(batch_size)]
        self._done = 0
        self._closed = False

    @property
    def latent_frames_done(self) -> int:
        return self._done

    @property
    def cache_bytes(self) -> int:
        """Bytes of this rank's band caches held between chunks."""
        return sum(t.numel() * t.element_size() for cache in self._caches for t in cache
                   if isinstance(t, torch.Tensor))

    def close(self) -> None:
        self._caches = []
        self._closed = True

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor | None:
        """z: the next latent frames (B, z_dim, k, h, w), de-normalised, identical on every rank -> (B, 3, n, H, W)
        in [-1, 1] on rank `dst`, None elsewhere."""
        if self._closed:
            raise RuntimeError("RowSplitWanDecoder is closed")
        if not isinstance(z, torch.Tensor) or z.ndim != 5 or z.shape[2] < 1 or \
                (z.shape[0], z.shape[3], z.shape[4]) != (self.batch_size, self.latent_height, self.latent_width):
            raise ValueError(f"z must be ({self.batch_size}, z_dim, k >= 1, {self.latent_height}, "
                             f"{self.latent_width}); got {tuple(z.shape) if isinstance(z, torch.Tensor) else z!r}")
        z = self.rows.take(z.to(device=self.device, dtype=self.dtype))             # (B, z_dim, k, band, w)
        start, videos = self._done, []
        with row_split_hooks(self.vae.decoder, self.rows):
            for b in range(self.batch_size):
                x = self.vae.post_quant_conv(z[b:b + 1])                           # 1x1x1: per position
                frames = [self.vae.decoder(x[:, :, f:f + 1], feat_cache=self._caches[b], feat_idx=[0],
                                           first_chunk=(start + f == 0))
                          for f in range(x.shape[2])]                              # (1, C, n_f, s band, s w)
                videos.append(torch.cat(frames, dim=2))
        self._done += z.shape[2]
        video = self.rows.gather_to_dst(torch.cat(videos))                         # (B, C, n, H, W) on dst
        if video is None:
            return None
        if self.vae.config.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            video = unpatchify(video, patch_size=self.vae.config.patch_size)      # (B, 3, n, H p, W p)
        return video.clamp_(-1.0, 1.0)
