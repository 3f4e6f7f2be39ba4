"""The live loop's model levers on a device, checked before they are timed (issue 41; tools/gpu_session_live.sh
runs it first): each lever's frames against the eager float32 loop on tiny-live, and its wall time per chunk (the
whole call over its chunks: indicative; `bench live` splits the stages).

    python -m tools.gpu_check_live_levers [--device cuda] [--json out/live_levers.json]

| lever | engine options | against the eager loop |
| --- | --- | --- |
| compile | compile=blocks (inductor; "eager" backend on the CPU) | latents within 1e-3 |
| CUDA graphs | compile=blocks, cuda_graphs=True (CUDA only: refused elsewhere, checked) | latents within 1e-3 |
| bf16 VAE | the live default on CUDA (vae_dtype unset) | frames within 0.05 |
| small decoder | decoder=tiny | frames within 0.03 on average (a different decoder) |

Exit status 1 when a check fails. On the CPU it checks what the CPU runs (compile with the eager backend, the
refusal of CUDA graphs, the small decoder): that is how this script is tested before a GPU session.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

CHUNKS = 8                          # tiny-live: 3 frames a chunk, the window full from chunk 3
RUN = dict(prompt_schedule=[[0, "a red ball bouncing"], [4, "a blue ball bouncing"]], seed=0, num_frames=3 * CHUNKS)


def run(device: str, output: str, **options) -> tuple[np.ndarray, float]:
    """tiny-live's video with `options`, and its second run's time per chunk (the first warms up)."""
    from longserve.pipelines import VideoPipeline

    with VideoPipeline.from_pretrained("tiny-live", device=device, workers=1, **options) as pipe:
        pipe("", output_type=output, **RUN)
        t0 = time.perf_counter()
        frames = np.asarray(pipe("", output_type=output, **RUN).frames, dtype=np.float32)
        return frames, (time.perf_counter() - t0) / CHUNKS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda, rows = args.device == "cuda", []

    def check(name, got, want, tol, s, reduce=np.max):
        diff = float(reduce(np.abs(got - want)))
        rows.append({"lever": name, f"{reduce.__name__}_abs_diff": diff, "tolerance": tol, "ok": diff <= tol,
                     "wall_ms_per_chunk": round(s * 1000, 2)})
        print(json.dumps(rows[-1]), flush=True)

    eager_latents, eager_s = run(args.device, "latent", vae_dtype="float32")
    eager_frames, _ = run(args.device, "np", vae_dtype="float32")
    rows.append({"lever": "eager float32", "wall_ms_per_chunk": round(eager_s * 1000, 2), "ok": True})
    print(json.dumps(rows[-1]), flush=True)
    backend = "inductor" if cuda else "eager"
    got, s = run(args.device, "latent", compile="blocks", compile_backend=backend)
    check("compile blocks", got, eager_latents, 1e-3, s)
    if cuda:
        got, s = run(args.device, "latent", compile="blocks", cuda_graphs=True)
        check("cuda graphs", got, eager_latents, 1e-3, s)
        got, s = run(args.device, "np")                                   # the live default: a bf16 VAE
        check("bf16 VAE (default)", got, eager_frames, 0.05, s)
    else:
        try:
            run(args.device, "latent", compile="blocks", compile_backend=backend, cuda_graphs=True)
            refused = False
        except ValueError as e:
            refused = "cuda_graphs" in str(e)
        rows.append({"lever": "cuda graphs refused off CUDA", "ok": refused})
        print(json.dumps(rows[-1]), flush=True)
    got, s = run(args.device, "np", decoder="tiny", vae_dtype="float32")
    check("small decoder", got, eager_frames, 0.03, s, reduce=np.mean)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
