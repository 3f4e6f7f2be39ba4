"""Wan VAE decode across the workers, chunk by chunk in time, in bounded memory.

diffusers' `AutoencoderKLWan` is causal in time: `_decode` feeds the decoder one latent
frame at a time and carries a cache of the previous frames' features per causal conv
(`feat_cache`). With tiling on and a frame larger than one tile, `tiled_decode` cuts the
latent frame into overlapping tiles, decodes every tile over all frames with its own
fresh cache, blends each tile with the (already blended) tile above and to its left
(`blend_v`, `blend_h`, in place, row by row), crops each tile to the stride and
concatenates. Every step after the decoder is per pixel frame.

`StreamingVAEDecoder` does the same work split into *work items*, one per (video b,
tile i, j) (one per video when the frame is not tiled), each with its own cache list that
lives across calls:

- time: the caller passes consecutive chunks of latent frames; every item decodes them
  one latent frame at a time, carrying its cache, so the chunks' outputs concatenated are
  the one-shot decode, and what stays alive between calls is the caches, not frames;
- workers: each rank decodes only its own items; their decoded tile chunks are packed
  into one flat buffer per rank and gathered to rank `dst` alone (`comm.gather_to`),
  which blends, crops, unpatchifies and clamps exactly as diffusers does.

Items are placed largest first (by latent tile area) on the least-loaded rank, ties to
`dst` first, then dst+1, ...: with equal tiles this is round-robin from `dst`; with the
smaller edge tiles of an uneven grid it keeps the decode work, the cache memory and the
bytes sent nearly equal, where round-robin can give one rank twice another's share (a
grid 2 tiles wide on 2 ranks puts every full tile on rank 0). A lone item (one untiled
video) lands on `dst`, and when no other rank has anything to send the gather is skipped.

The gather (`dist.gather`, one collective that NCCL and gloo both run) needs equal sizes,
so every rank's flat payload is zero-padded to the largest rank's: little waste when the
tiles balance, up to one chunk per idle rank when whole videos are fewer than the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longserve.engine import comm
from longserve.engine.dist import ParallelGroup


@dataclass(frozen=True)
class VAETiling:
    """Spatial tiling in output pixels, as `AutoencoderKLWan.enable_tiling` takes it (diffusers' defaults)."""

    sample_min_height: int = 256
    sample_min_width: int = 256
    sample_stride_height: int = 192
    sample_stride_width: int = 192

    def __post_init__(self):
        for name in ("sample_min_height", "sample_min_width", "sample_stride_height", "sample_stride_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tiling.{name} must be a positive integer, got {value!r}")
        for side in ("height", "width"):
            if getattr(self, f"sample_stride_{side}") > getattr(self, f"sample_min_{side}"):
                # tiles further apart than they are long would leave unblended gaps
                raise ValueError(f"tiling.sample_stride_{side} must be <= tiling.sample_min_{side}, got "
                                 f"{getattr(self, f'sample_stride_{side}')} > {getattr(self, f'sample_min_{side}')}")


@dataclass(frozen=True)
class _Item:
    """One work item: video `video`, tile (`row`, `col`), the latent window it decodes."""

    index: int
    video: int
    row: int
    col: int
    top: int
    left: int
    height: int  # latent pixels
    width: int


def assign_items(areas: list[int], world_size: int, first: int = 0) -> list[list[int]]:
    """Item indices per rank: largest area first, each to the least-loaded rank (ties: `first`,
    then first+1, ... cyclically)."""
    loads = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(areas)), key=lambda i: (-areas[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], (r - first) % world_size))
        owned[rank].append(index)
        loads[rank] += areas[index]
    return [sorted(items) for items in owned]


def _decoder_conv_count(vae) -> int:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())


class StreamingVAEDecoder:
    """Decode Wan latents chunk by chunk in time, split across the ranks of `pg`, gathered on `dst`.

    The chunks' outputs concatenated equal diffusers' `vae.decode(z).sample` on the whole
    video: its tiled decode (after `vae.enable_tiling` with `tiling`'s four numbers) when
    `tiling` is given and the latent frame is larger than one tile (diffusers' own test in
    `_decode`), its plain per-frame decode otherwise. Bitwise equal to diffusers' decode of
    each video alone; diffusers' decode of a batch differs from that by rounding only.

    Work items are (video, tile) pairs, placed on ranks by `assign_items`. Without tiling,
    or when the frame fits one tile, an item is a whole video, so the split is by video
    only: with one video, rank `dst` decodes it and the others idle (no communication).

    Memory: between calls a rank holds its own items' caches (about 1/N of them); during
    a call, also one item-frame's activations, its share of the chunk's decoded tiles,
    and on `dst` the gathered chunk and the returned frames.

    Every rank must call `decode` with the same chunk, in the same order (it is a
    collective). Decoding runs under `torch.no_grad()`: an autograd graph would keep every
    chunk alive through the caches. `z` is cast to the VAE's dtype and device, as the Wan
    pipelines do before `vae.decode`. The VAE's own state (`use_tiling`, `_feat_map`) is
    neither read nor changed: tiling comes from `tiling` alone.
    """

    def __init__(self, vae, pg: ParallelGroup, batch_size: int, latent_height: int, latent_width: int,
                 tiling: VAETiling | None = None, dst: int = 0):
        from diffusers import AutoencoderKLWan

        if not isinstance(vae, AutoencoderKLWan):
            raise ValueError(f"vae must be diffusers' AutoencoderKLWan, got {type(vae).__name__}")
        for name, value in (("batch_size", batch_size), ("latent_height", latent_height),
                            ("latent_width", latent_width)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if tiling is not None and not isinstance(tiling, VAETiling):
            raise ValueError(f"tiling must be a VAETiling or None, got {type(tiling).__name__}")
        if not isinstance(dst, int) or not 0 <= dst < pg.world_size:
            raise ValueError(f"dst must be a rank of the group, 0..{pg.world_size - 1}; got {dst!r}")
        self.vae = vae
        self.pg = pg
        self.batch_size = batch_size
        self.latent_height = latent_height
        self.latent_width = latent_width
        self.dst = dst
        param = next(vae.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.patch_size = vae.config.patch_size
        self._plan_tiles(tiling)
        self._probe_decoder()
        areas = [item.height * item.width for item in self.items]
        self.owned = assign_items(areas, pg.world_size, first=dst)  # item indices per rank
        self._caches = {i: [None] * self._conv_count for i in self.owned[pg.rank]}
        self._done = 0
        self._closed = False

    # -- plan ---------------------------------------------------------------------

    def _plan_tiles(self, tiling: VAETiling | None) -> None:
        """Work items and the blend/crop geometry, with diffusers' `_decode` / `tiled_decode` arithmetic."""
        ratio = self.vae.spatial_compression_ratio
        h, w = self.latent_height, self.latent_width
        self.tiled = tiling is not None and (w > tiling.sample_min_width // ratio
                                             or h > tiling.sample_min_height // ratio)
        if not self.tiled:
            rows, cols = [(0, h)], [(0, w)]
        else:
            for side in ("height", "width"):
                if getattr(tiling, f"sample_stride_{side}") < ratio:
                    raise ValueError(f"tiling.sample_stride_{side} must be >= the VAE's spatial compression "
                                     f"({ratio}), got {getattr(tiling, f'sample_stride_{side}')}")
            min_h, min_w = tiling.sample_min_height // ratio, tiling.sample_min_width // ratio
            rows = [(i, min(min_h, h - i)) for i in range(0, h, tiling.sample_stride_height // ratio)]
            cols = [(j, min(min_w, w - j)) for j in range(0, w, tiling.sample_stride_width // ratio)]
            # in the decoder's output space (pixels / patch_size), as tiled_decode computes them
            p = self.patch_size or 1
            self.crop_height = tiling.sample_stride_height // p
            self.crop_width = tiling.sample_stride_width // p
            self.blend_height = tiling.sample_min_height // p - self.crop_height
            self.blend_width = tiling.sample_min_width // p - self.crop_width
            self.out_height = h * ratio // p
            self.out_width = w * ratio // p
        self.grid = (len(rows), len(cols))
        self.items = [_Item(len(rows) * len(cols) * b + len(cols) * i + j, b, i, j, top, left, th, tw)
                      for b in range(self.batch_size)
                      for i, (top, th) in enumerate(rows)
                      for j, (left, tw) in enumerate(cols)]

    @torch.no_grad()
    def _probe_decoder(self) -> None:
        """Read the decoder's output geometry off what it returns for two frames of a 2x2 latent:
        pixel frames for latent frame 0 and for every later one, channels, pixels per latent pixel.

        2x2, not 1x1: the decoder's middle attention block attends over the latent's h*w positions,
        and a sequence of length 1 reaches SDPA with a degenerate stride that CUDA's memory-efficient
        kernel rejects ("query is not correctly aligned (strideM)"; found on an H100, docs/gpu.md)."""
        self._conv_count = _decoder_conv_count(self.vae)
        cache = [None] * self._conv_count
        z = torch.zeros(1, self.vae.config.z_dim, 1, 2, 2, dtype=self.dtype, device=self.device)
        first = self.vae.decoder(self.vae.post_quant_conv(z), feat_cache=cache, feat_idx=[0], first_chunk=True)
        later = self.vae.decoder(self.vae.post_quant_conv(z), feat_cache=cache, feat_idx=[0])
        self.frames_first, self.frames_later = first.shape[2], later.shape[2]
        self.out_channels = first.shape[1]
        self.scale_h, self.scale_w = first.shape[3] // z.shape[3], first.shape[4] // z.shape[4]
        if not self.tiled:
            self.out_height, self.out_width = self.latent_height * self.scale_h, self.latent_width * self.scale_w

    def _pixel_frames(self, start: int, count: int) -> int:
        """Pixel frames that latent frames [start, start + count) decode to."""
        return sum(self.frames_first if k == 0 else self.frames_later for k in range(start, start + count))

    def _tile_shape(self, item: _Item, frames: int) -> tuple[int, ...]:
        return (1, self.out_channels, frames, item.height * self.scale_h, item.width * self.scale_w)

    def _payload_size(self, rank: int, frames: int) -> int:
        return sum(torch.Size(self._tile_shape(self.items[i], frames)).numel() for i in self.owned[rank])

    @property
    def latent_frames_done(self) -> int:
        """Latent frames decoded so far (the next chunk starts at this latent frame)."""
        return self._done

    @property
    def cache_bytes(self) -> int:
        """Bytes of the causal convolutions' caches this rank holds between chunks (what stays in memory)."""
        return sum(t.numel() * t.element_size() for cache in self._caches.values() for t in cache
                   if isinstance(t, torch.Tensor))

    def close(self) -> None:
        """Drop the caches; `decode` may not be called again."""
        self._caches = {}
        self._closed = True

    # -- decode -------------------------------------------------------------------

    def _check(self, z) -> None:
        if self._closed:
            raise RuntimeError("StreamingVAEDecoder is closed")
        if not isinstance(z, torch.Tensor) or z.ndim != 5:
            raise ValueError(f"z must be a 5-D tensor (B, z_dim, k, h, w), got "
                             f"{tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__}")
        B, C, k, h, w = z.shape
        for name, got, want in (("batch", B, self.batch_size), ("channels", C, self.vae.config.z_dim),
                                ("height", h, self.latent_height), ("width", w, self.latent_width)):
            if got != want:
                raise ValueError(f"z: {name} must be {want}, got {got} (z.shape = {tuple(z.shape)})")
        if k < 1:
            raise ValueError(f"z: the chunk must hold at least one latent frame, got {k} (z.shape = {tuple(z.shape)})")

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor | None:
        """z: the next latent frames (B, z_dim, k, h, w), already de-normalised (latents * std + mean),
        identical on every rank. Returns (B, 3, n, H, W) in [-1, 1] on rank `dst`, None elsewhere.

        n is the pixel frames these latent frames decode to (Wan: 1 for latent frame 0, 4 for every
        later one); H, W are the latent size times the VAE's spatial compression.
        """
        self._check(z)
        z = z.to(device=self.device, dtype=self.dtype)  # (B, z_dim, k, h, w)
        start, k = self._done, z.shape[2]
        frames = self._pixel_frames(start, k)
        sizes = [self._payload_size(r, frames) for r in range(self.pg.world_size)]
        payload = torch.empty(max(sizes), dtype=self.dtype, device=self.device)  # (L,) this rank's tiles, flat
        offset = 0
        for index in self.owned[self.pg.rank]:
            item = self.items[index]
            shape = self._tile_shape(item, frames)
            tile = payload[offset:offset + torch.Size(shape).numel()].view(shape)  # (1, C, n, th, tw)
            self._decode_item(item, z, start, tile)
            offset += tile.numel()
        payload[offset:].zero_()  # pad to the longest rank's payload: gather needs equal sizes
        self._done += k
        if any(size for r, size in enumerate(sizes) if r != self.dst):
            gathered = comm.gather_to(payload, self.dst, self.pg)  # (N, L) on dst, None elsewhere
            if gathered is None:
                return None
            payloads = list(gathered.unbind(0))  # rank r's (L,)
        elif self.pg.rank == self.dst:  # every item is dst's own: nothing to gather
            payloads = {self.dst: payload}
        else:
            return None
        return self._assemble(payloads, frames)

    def _decode_item(self, item: _Item, z: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """Decode `item`'s window of the chunk into `out` (1, C, n, th, tw), one latent frame at a time."""
        cache = self._caches[item.index]
        window = z[item.video:item.video + 1, :, :, item.top:item.top + item.height,
                   item.left:item.left + item.width]  # (1, z_dim, k, th, tw)
        if not self.tiled:
            window = self.vae.post_quant_conv(window)  # _decode: one post_quant_conv over all frames
        at = 0
        for f in range(window.shape[2]):
            x = window[:, :, f:f + 1]  # (1, z_dim, 1, th, tw)
            if self.tiled:
                x = self.vae.post_quant_conv(x)  # tiled_decode: per tile and frame
            decoded = self.vae.decoder(x, feat_cache=cache, feat_idx=[0], first_chunk=(start + f == 0))
            n = decoded.shape[2]
            if decoded.shape[:2] + decoded.shape[3:] != out.shape[:2] + out.shape[3:] or at + n > out.shape[2]:
                raise RuntimeError(f"decoder returned {tuple(decoded.shape)} for latent frame {start + f}, "
                                   f"outside the planned {tuple(out.shape)}")
            out[:, :, at:at + n] = decoded  # (1, C, n_f, th, tw)
            at += n

    def _assemble(self, payloads, frames: int) -> torch.Tensor:
        """On dst: unpack every item's tile chunk, blend and crop as tiled_decode, unpatchify, clamp.

        payloads[r]: rank r's flat payload (its items' (1, C, n, th, tw) chunks, in item order).
        """
        tiles: dict[tuple[int, int, int], torch.Tensor] = {}
        for rank, indices in enumerate(self.owned):
            offset = 0
            for index in indices:
                item = self.items[index]
                shape = self._tile_shape(item, frames)
                size = torch.Size(shape).numel()
                tiles[item.video, item.row, item.col] = payloads[rank][offset:offset + size].view(shape)
                offset += size
        if not self.tiled and self.owned[self.dst] == list(range(self.batch_size)):
            # dst decoded every video, in order: its payload already is the batch
            shape = (self.batch_size, *self._tile_shape(self.items[0], frames)[1:])
            video = payloads[self.dst][:torch.Size(shape).numel()].view(shape)  # (B, C, n, H, W)
        elif not self.tiled:
            video = torch.cat([tiles[b, 0, 0] for b in range(self.batch_size)])  # (B, C, n, H, W)
        else:
            video = self._blend(tiles, frames)
        if self.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            video = unpatchify(video, patch_size=self.patch_size)  # (B, 3, n, H*p, W*p)
        return video.clamp_(-1.0, 1.0)

    def _blend(self, tiles: dict, frames: int) -> torch.Tensor:
        """tiled_decode's blend and crop, on this chunk's frames (every step is per pixel frame).

        Tile (i, j) is blended in place with tile (i-1, j) and then (i, j-1), both already
        blended, in row-major order; each is then cropped to the stride and placed after the
        crops before it, and the whole is cut to the output size.
        """
        rows, cols = self.grid
        crop_h = [min(self.crop_height, tiles[0, i, 0].shape[3]) for i in range(rows)]
        crop_w = [min(self.crop_width, tiles[0, 0, j].shape[4]) for j in range(cols)]
        height = min(self.out_height, sum(crop_h))
        width = min(self.out_width, sum(crop_w))
        video = torch.empty((self.batch_size, self.out_channels, frames, height, width),
                            dtype=self.dtype, device=self.device)  # (B, C, n, H, W)
        for b in range(self.batch_size):
            top = 0
            for i in range(rows):
                left = 0
                for j in range(cols):
                    tile = tiles[b, i, j]  # (1, C, n, th, tw)
                    if i > 0:
                        tile = self.vae.blend_v(tiles[b, i - 1, j], tile, self.blend_height)
                    if j > 0:
                        tile = self.vae.blend_h(tiles[b, i, j - 1], tile, self.blend_width)
                    h, w = min(crop_h[i], height - top), min(crop_w[j], width - left)
                    if h > 0 and w > 0:
                        video[b, :, :, top:top + h, left:left + w] = tile[0, :, :, :h, :w]
                    left += crop_w[j]
                top += crop_h[i]
        return video
