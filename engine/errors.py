"""The error that blames a request's input, in a module of its own: the engine's lowest layers (the config's
checks, step caching, LoRA) raise it without importing the request's completion, which imports them."""

from __future__ import annotations


class RequestError(ValueError):
    """The request's input is invalid: the caller's fault (HTTP 4xx), raised before any worker ran.

    `field` names the argument at fault ("num_frames", "size", "ar_step", ...).
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


__all__ = ["RequestError"]
