"""`longserve score FILE`: the log-likelihood, perplexity and bits per byte of a text file.

    longserve score book.txt --model tiny-lm --workers 2 [--strategy lss|ring] [--zigzag]
                             [--window W --stride S] [--json]

FILE is read as UTF-8 (`-` reads stdin). The text is scored sequence-parallel over the
workers (see pipelines/scoring.py for what is scored: BOS convention, windows).
Exit status 2, with a message naming the problem, for a missing or non-UTF-8 file, a
missing model, or a bad option.
"""

from __future__ import annotations

import json
import sys


def add_arguments(parser) -> None:
    parser.add_argument("file", metavar="FILE", help="UTF-8 text file to score, or - for stdin")
    parser.add_argument("--model", default="tiny-lm", help="'tiny-lm' or a local transformers causal-LM directory")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (sequence-parallel degree)")
    parser.add_argument("--strategy", default="lss", choices=["lss", "ring"],
                        help="lss: one fused K/V all-gather per layer; ring: K/V blocks around the ring, O(L/N) memory")
    parser.add_argument("--zigzag", action="store_true", help="zigzag sharding (rank r holds chunks r and 2N-1-r)")
    parser.add_argument("--window", type=int, default=None,
                        help="sliding-window scoring for texts longer than the model's positions: tokens per window")
    parser.add_argument("--stride", type=int, default=None, help="tokens each window advances (with --window)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: float32")
    parser.add_argument("--token-logprobs", action="store_true", help="include per-token log-probabilities (--json)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _fail(message: str) -> int:
    print(f"longserve score: error: {message}", file=sys.stderr)
    return 2


def read_text(file: str) -> str:
    """The UTF-8 text of `file` ('-' = stdin); ValueError naming the file otherwise."""
    name = "<stdin>" if file == "-" else file
    try:
        data = sys.stdin.buffer.read() if file == "-" else open(file, "rb").read()
    except OSError as e:
        raise ValueError(f"cannot read {name}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not valid UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def run(args) -> int:
    from longserve.weights.lm import resolve_causal_lm

    try:
        resolve_causal_lm(args.model)
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    try:
        text = read_text(args.file)
    except ValueError as e:
        return _fail(str(e))

    from tqdm.auto import tqdm

    from longserve.pipelines.scoring import TextScoringPipeline

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="layer", desc="scoring", file=sys.stderr,
                       disable=True if args.no_progress else None)  # None: only on a terminal
        bar.update(done - bar.n)

    with TextScoringPipeline.from_pretrained(args.model, workers=args.workers, strategy=args.strategy,
                                             zigzag=args.zigzag, device=args.device, dtype=args.dtype) as scorer:
        try:
            r = scorer.score(text, window=args.window, stride=args.stride,
                             return_token_logprobs=args.token_logprobs, progress=progress)
        finally:
            if bar is not None:
                bar.close()
    if args.json:
        out = r.to_dict()
        out.update(file=args.file, model=args.model)
        if not args.token_logprobs:
            out.pop("token_logprobs"), out.pop("token_ids")
        print(json.dumps(out, indent=2))
    else:
        print(f"file           {args.file}")
        print(f"model          {args.model} ({r.workers} worker(s), {r.strategy}{', zigzag' if r.zigzag else ''}"
              f"{f', {r.windows} windows' if r.windows > 1 else ''})")
        print(f"tokens scored  {r.num_tokens}  (bytes {r.num_bytes}, BOS {'prepended' if r.add_bos else 'none'})")
        print(f"total NLL      {r.total_nll:.6f} nats")
        print(f"mean NLL       {r.mean_nll:.6f} nats/token")
        print(f"perplexity     {r.perplexity:.4f}")
        print(f"bits per byte  {r.bits_per_byte:.6f}")
        print(f"seconds        {r.seconds:.3f}")
    return 0
