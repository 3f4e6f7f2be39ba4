"""`longserve bench TARGET`: every benchmark prints a table, and can write JSON and a plot.

Targets register here by module; each has `add_arguments(parser)` and `run(args)`.
"""

from __future__ import annotations

import importlib

BENCHES = {
    "transformer": ("server.bench_transformer", "parallel strategies on one ST-DiT forward+step"),
    "generate": ("server.bench_generate", "seconds per video and worker-pool overhead"),
    "serve": ("server.bench_serve", "HTTP server throughput and latency under concurrency"),
    "score": ("server.bench_score", "LSS / ring long-text scoring: time, memory, bytes"),
}


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, (module_name, help_text) in BENCHES.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_bench=module.run)


def run(args) -> int:
    return args._bench(args)
