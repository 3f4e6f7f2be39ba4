"""A small decoder for live video: TAEHV's decoder shape, loaded from its published weight format.

TAEHV (Tiny AutoEncoder for Hunyuan Video, github.com/madebyollin/taehv; its Wan 2.1 file is
`taew2_1.pth`) decodes exactly the latents a diffusion model makes (no `latents_mean` / `latents_std`)
into frames in [0, 1], at a small fraction of the Wan VAE's cost: every layer is a 2D conv on one
frame, and time enters only through *memory blocks*, each of which reads its own input of the
frame before. This module is our own code for that decoder, written from its description and
weight layout, so that its published files load as they are:

    decoder.0             clamp: 3 tanh(x / 3)
    decoder.1, .2         conv 3x3 latents -> w0, ReLU
    decoder.3-5           3 memory blocks of w0           conv 3x3 (2 w -> w), ReLU, conv, ReLU, conv; + x; ReLU
    decoder.6, .7, .8     2x upsample, time grow (1x1 conv w0 -> s0 * w0: s0 frames a frame), conv 3x3 -> w1
    decoder.9-14          the same at w1 (stride s1) -> w2
    decoder.15-20         the same at w2 (stride s2) -> w3
    decoder.21, .22       ReLU, conv 3x3 w3 -> 3 * patch^2 (pixel shuffle by `patch`), then clamp to [0, 1]

Keys are `decoder.<index>.<...>` (an `encoder.*` half, if the file has one, is not loaded). The
widths, latent channels, time strides and patch are read from the file's shapes, so TAEHV's own
files (widths 256, 128, 64, 64) and the small ones trained here (tools/weights/train_tiny_decoder.py)
load the same way. A time upscale of T (the product of the strides) gives T frames a latent frame;
the stream's first T - 1 frames are dropped, so a video decodes to 1 + T (n - 1) frames, as Wan's
causal VAE does. Spatially it is always 8x (three 2x upsamples) times `patch`.

Streaming: `SmallDecoder.decode(latents, state)` decodes a chunk of latent frames; the state
carries each memory block's last input frame, so chunks decoded one after another equal the whole
video decoded at once. `SmallDecoderPath` is the live loop's frame path (engine/decoding.py's
`FrameStream` interface): rank 0 decodes, every other rank skips it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIELD = "decoder"


class _Clamp(nn.Module):
    def forward(self, x):
        return torch.tanh(x / 3) * 3


def _conv(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


class MemoryBlock(nn.Module):
    """A residual conv block that also reads its input of the previous frame (`past`, zeros at the start)."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Sequential(_conv(2 * width, width), nn.ReLU(), _conv(width, width), nn.ReLU(),
                                  _conv(width, width))
        self.skip = nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x, past):                      # x, past: (frames, w, H, W)
        return self.act(self.conv(torch.cat([x, past], 1)) + self.skip(x))


class TimeGrow(nn.Module):
    """Each frame -> `stride` frames: a 1x1 conv to stride x the channels, split into consecutive frames."""

    def __init__(self, width: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(width, width * stride, 1, bias=False)

    def forward(self, x):                            # (frames, w, H, W) -> (frames * stride, w, H, W)
        return self.conv(x).reshape(-1, x.shape[1], *x.shape[2:])


class SmallDecoder(nn.Module):
    """TAEHV's decoder at any widths: normalised latents (N, C, T, h, w) -> frames (N, T', 3, H, W) in [0, 1]."""

    def __init__(self, latent_channels: int, widths=(256, 128, 64, 64), strides=(1, 2, 2), patch: int = 1):
        super().__init__()
        w0, w1, w2, w3 = widths
        self.latent_channels, self.patch = latent_channels, patch
        self.widths, self.strides = tuple(widths), tuple(strides)
        layers = [_Clamp(), _conv(latent_channels, w0), nn.ReLU()]
        for width, nxt, stride in zip((w0, w1, w2), (w1, w2, w3), strides):
            layers += [MemoryBlock(width), MemoryBlock(width), MemoryBlock(width), nn.Upsample(scale_factor=2),
                       TimeGrow(width, stride), _conv(width, nxt, bias=False)]
        layers += [nn.ReLU(), _conv(w3, 3 * patch * patch)]
        self.decoder = nn.Sequential(*layers)

    @property
    def time_upscale(self) -> int:
        return math.prod(self.strides)

    @property
    def space_upscale(self) -> int:
        return 8 * self.patch

    @classmethod
    def from_state_dict(cls, sd: dict) -> "SmallDecoder":
        """The decoder a TAEHV-format state dict describes (its shapes), with its weights (strict)."""
        sd = {k: v for k, v in sd.items() if k.startswith("decoder.")}
        try:
            latent = sd["decoder.1.weight"].shape[1]
            widths = [sd["decoder.1.weight"].shape[0]] + [sd[f"decoder.{i}.weight"].shape[0] for i in (8, 14, 20)]
            strides = [sd[f"decoder.{i}.conv.weight"].shape[0] // sd[f"decoder.{i}.conv.weight"].shape[1]
                       for i in (7, 13, 19)]
            patch = math.isqrt(sd["decoder.22.weight"].shape[0] // 3)
        except KeyError as e:
            raise ValueError(f"{FIELD}: not a TAEHV decoder state dict (no {e.args[0]!r})") from None
        model = cls(latent, widths, strides, patch)
        model.load_state_dict(sd, strict=True)
        return model

    @classmethod
    def load(cls, path: str | Path) -> "SmallDecoder":
        """A TAEHV weight file: `.pth` (a state dict, as published) or `.safetensors`."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{FIELD}: no small-decoder weights at {str(path)!r} (a TAEHV .pth or .safetensors)")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        return cls.from_state_dict({k: v.float() for k, v in sd.items()})

    def check_latents(self, latent_channels: int, temporal: int, spatial: int, where: str = "this model") -> None:
        """Refuse a decoder that cannot decode these latents (ValueError naming the field)."""
        if latent_channels != self.latent_channels:
            raise ValueError(f"{FIELD}: the small decoder takes {self.latent_channels} latent channels; {where}'s "
                             f"latents have {latent_channels} (TAEHV's taew2_1 is for Wan 2.1's 16)")
        if (temporal, spatial) != (self.time_upscale, self.space_upscale):
            raise ValueError(f"{FIELD}: the small decoder upscales {self.time_upscale}x in time and "
                             f"{self.space_upscale}x in space; {where}'s VAE {temporal}x and {spatial}x")

    def start(self) -> list:
        """A new stream's state: each memory block's last input (None: zeros), frames still to drop."""
        return [None] * len(self.decoder) + [self.time_upscale - 1]

    def decode(self, latents: torch.Tensor, state: list) -> torch.Tensor:
        """latents (N, C, T, h, w) -> frames (N, T', 3, H, W) in [0, 1], after the frames before (`state`)."""
        N, _, T = latents.shape[:3]
        x = latents.transpose(1, 2).flatten(0, 1)                        # (N*T, C, h, w), time inner
        for i, layer in enumerate(self.decoder):
            if isinstance(layer, MemoryBlock):
                frames = x.unflatten(0, (N, -1))                          # (N, t, w, H, W)
                last = state[i] if state[i] is not None else torch.zeros_like(frames[:, :1])
                past = torch.cat([last, frames[:, :-1]], dim=1).flatten(0, 1)
                state[i] = frames[:, -1:]
                x = layer(x, past)
            else:
                x = layer(x)
        if self.patch > 1:
            x = F.pixel_shuffle(x, self.patch)
        video = x.clamp(0, 1).unflatten(0, (N, -1))                       # (N, T*time_upscale, 3, H, W)
        drop = min(state[-1], video.shape[1])
        state[-1] -= drop
        return video[:, drop:]


#: `decoder="tiny"`: the small decoder shipped for a shipped model (weights/, tools/weights/train_tiny_decoder.py)
SHIPPED = {"tiny-live": "tiny-decoder-live/tiny_decoder.pth"}


def decoder_weights(decoder: str, model_dir: str | Path) -> Path:
    """The weight file `decoder` ("tiny" or a path) names for the model at `model_dir`."""
    if decoder != "tiny":
        return Path(decoder).expanduser()
    from longserve.weights.registry import TINY_MODELS

    here = Path(model_dir).resolve()
    for name, rel in SHIPPED.items():
        if name in TINY_MODELS and Path(TINY_MODELS[name]).resolve() == here:
            return Path(TINY_MODELS[name]).parent / rel
    raise ValueError(f"{FIELD}='tiny': no small decoder ships for {str(model_dir)!r} (one does for "
                     f"{', '.join(SHIPPED)}); give the path of a TAEHV weight file instead (taew2_1.pth for "
                     f"Wan 2.1 latents)")


def open_small_decoder(decoder: str, model_dir: str | Path) -> SmallDecoder:
    """The small decoder `decoder` names, checked against the model's VAE (its latent channels and factors)."""
    import json

    from longserve.engine.families.wan_parts import vae_factors

    vae = json.loads((Path(model_dir) / "vae" / "config.json").read_text())
    spatial, temporal = vae_factors(vae)
    model = SmallDecoder.load(decoder_weights(decoder, model_dir))
    model.check_latents(vae["z_dim"], temporal, spatial, where=Path(model_dir).name)
    return model.eval().requires_grad_(False)


class SmallDecoderPath:
    """The live loop's frames through a `SmallDecoder` (engine/decoding.py's decoder interface): rank 0 decodes
    the request's latents as they come, carrying the stream's memory; other ranks do nothing."""

    def __init__(self, decoder: SmallDecoder, rank: int, output: str, slots=None):
        self.decoder, self.rank, self.output, self.slots = decoder, rank, output, slots
        self.state = decoder.start()

    def decode(self, latents: torch.Tensor, keep: slice):
        if self.rank != 0:
            return None
        p = next(self.decoder.parameters())
        with torch.no_grad():
            frames = self.decoder.decode(latents.to(p.device, p.dtype), self.state)     # (B, n, 3, H, W)
        if self.slots is not None:          # uint8 made on the device, out through shared memory (live_frames.py)
            from longserve.engine.live_frames import to_uint8

            return self.slots.put(to_uint8(frames[:, keep].transpose(1, 2), unit=True))
        frames = frames[:, keep].permute(0, 1, 3, 4, 2).float().cpu().numpy()        # (B, n, H, W, 3) in [0, 1]
        if self.output == "uint8":
            return (frames * 255).round().astype(np.uint8)
        return frames

    def close(self) -> None:
        self.state = None
