"""Seeded random weights in TAEHV's published shape and format, for timing the small decoder where TAEHV's own file
is not at hand (the GPU session: `bench live --decoder /tmp/taew2_1_random.pth`). The frames it draws are noise;
its cost is TAEHV's: widths 256, 128, 64, 64, time strides 1, 2, 2 (Wan 2.1's `taew2_1.pth`), float16 tensors.

    python -m tools.weights.random_taehv -o /tmp/taew2_1_random.pth [--latent-channels 16]
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.random_taehv", description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--latent-channels", type=int, default=16, help="16: Wan 2.1's latents")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from longserve.engine.small_decoder import SmallDecoder

    torch.manual_seed(args.seed)
    model = SmallDecoder(args.latent_channels, (256, 128, 64, 64), (1, 2, 2), 1)
    torch.save({k: v.half() for k, v in model.state_dict().items()}, args.output)
    print(f"{args.output}: {sum(p.numel() for p in model.parameters())} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
