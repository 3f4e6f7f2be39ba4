"""The `longserve` command: generate | live | serve | score | bench.

Each subcommand lives in its own module with `add_arguments(parser)` and `run(args)`;
modules import their heavy dependencies (torch, diffusers) inside `run`, so `--help`
stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": ("longserve.server.cli.generate", "generate a video from a prompt"),
    "live": ("longserve.server.cli.live", "a live video on a causal model, with prompt switches, to an MP4"),
    "serve": ("longserve.server.cli.serve", "run the OpenAI-compatible HTTP server"),
    "score": ("longserve.server.cli.score", "score a long text with a causal LM (LSS sequence parallel)"),
}
# the bench targets named from bench's own table (a light module: names and help only)
COMMANDS["bench"] = ("longserve.server.cli.bench",
                     "benchmarks: " + " | ".join(importlib.import_module("longserve.server.cli.bench").BENCHES))


def add_subcommands(parser: argparse.ArgumentParser, dest: str, table: dict[str, tuple[str, str]],
                    run_key: str) -> None:
    """One sub-parser per `table` entry (name -> (module, help)); the module's `run` lands in `run_key`."""
    sub = parser.add_subparsers(dest=dest, required=True, metavar=dest.upper())
    for name, (module_name, help_text) in table.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # not built in this checkout
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        # `check(args)`, where a module has one: what can be refused without the model, before any heavy import
        p.set_defaults(**{run_key: module.run, "_check": getattr(module, "check", None)})
        parser.commands = {**getattr(parser, "commands", {}), name: p}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longserve", description=__doc__.splitlines()[0])
    add_subcommands(parser, "command", COMMANDS, "_run")
    return parser


def with_config_file(parser: argparse.ArgumentParser, args, argv: list[str]):
    """`serve --config FILE`: the file's settings become the command's defaults and `argv` is parsed again, so a
    flag on the command line wins over the file, and the file over the built-in defaults."""
    if args.command != "serve" or not getattr(args, "config", None):
        return args
    from longserve.server.cli.serve import config_file_defaults

    serve = parser.commands["serve"]
    serve.set_defaults(**config_file_defaults(args.config, serve))
    return parser.parse_args(argv)


#: commands whose own process starts a worker pool: the fork server is launched before their heavy imports
STARTS_WORKERS = ("generate", "live", "serve")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        args = with_config_file(parser, args, argv)
        if args._check is not None:      # bad arguments are refused at once, before the fork server and the load
            args._check(args)
        if args.command in STARTS_WORKERS:
            from longserve.engine.startup import prestart

            prestart(args.device, args.launcher)
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # bad arguments, missing model: a message, not a traceback
        print(f"longserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
