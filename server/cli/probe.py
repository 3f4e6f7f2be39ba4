"""`python -m longserve.server.cli.probe [--live] [--pid N]`: the image's HEALTHCHECK, on the port the server was given.

A Dockerfile's HEALTHCHECK cannot see the arguments a `docker run IMAGE ARGS...` added, so a probe with a fixed port
checks the wrong one after `--port 9000`. This one reads the server's own command line (`/proc/<pid>/cmdline`,
process 1 in a container: the entrypoint and the arguments after the image name), parses it with `longserve serve`'s
own parser (a `--config` file included, as the server reads it), and asks `/health/ready` (or `/health/live` with
`--live`) on that host and port. Exit 0 on 200, else 1 with one line saying why.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from pathlib import Path

#: a wildcard address is probed on the loopback address of its family
WILDCARDS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1", "[::]": "::1"}


def serve_address(argv: list[str]) -> tuple[str, int]:
    """(host, port) a `longserve serve` command line listens on: `argv` is the whole command line (`longserve serve
    ...`, or `python -m longserve.server.cli serve ...`); the last flag wins, a --config file is read as the server
    reads it (a flag on the command line wins over it)."""
    from longserve.server.cli import build_parser

    if "serve" not in argv:
        raise ValueError(f"not a `longserve serve` command line: {' '.join(argv)[:200]}")
    words = argv[argv.index("serve") + 1:]
    parser = build_parser().commands["serve"]
    args, _ = parser.parse_known_args(words)
    if args.config:
        from longserve.server.cli.serve import config_file_defaults

        parser.set_defaults(**config_file_defaults(args.config, parser))
        args, _ = parser.parse_known_args(words)
    host = WILDCARDS.get(args.host, args.host)
    return host, int(args.port)


def probe_url(host: str, port: int, live: bool = False) -> str:
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{host}:{port}/health/{'live' if live else 'ready'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m longserve.server.cli.probe", description=__doc__.splitlines()[0])
    p.add_argument("--pid", type=int, default=1, help="the server's process id (default 1: a container's)")
    p.add_argument("--live", action="store_true", help="ask /health/live (the process answers) instead of ready")
    p.add_argument("--timeout", type=float, default=8.0)
    args = p.parse_args(argv)
    try:
        cmdline = Path(f"/proc/{args.pid}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")
        url = probe_url(*serve_address([w for w in cmdline if w]), live=args.live)
    except (OSError, ValueError, SystemExit) as e:
        print(f"probe: cannot read the server's command line (pid {args.pid}): {e}", file=sys.stderr)
        return 1
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as r:
            return 0 if r.status == 200 else 1
    except urllib.error.HTTPError as e:
        print(f"probe: {url} answered {e.code}", file=sys.stderr)
    except (OSError, urllib.error.URLError) as e:
        print(f"probe: {url}: {getattr(e, 'reason', e)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
