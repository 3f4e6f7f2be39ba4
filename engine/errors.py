"""The error that blames a request's input, in a module of its own: the engine's lowest layers (the config's
checks, step caching, LoRA) raise it without importing the request's completion, which imports them."""

from __future__ import annotations

import re

#: an absolute file path as a traceback or an OS error writes it (POSIX or Windows)
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@+~-]+){2,}[\\/]?")


class RequestError(ValueError):
    """The request's input is invalid: the caller's fault (HTTP 4xx), raised before any worker ran.

    `field` names the argument at fault ("num_frames", "size", "ar_step", ...).
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def public_message(text: str, limit: int = 300) -> str:
    """`text` as a client may see it: its first line only (never a traceback), server file paths cut to their
    last name ("<path>/pool.py"), at most `limit` characters. The server's log keeps the whole text."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    line = _PATH.sub(lambda m: "<path>/" + m.group(0).rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1], line)
    return line if len(line) <= limit else line[:limit - 3] + "..."


__all__ = ["RequestError", "public_message"]
