"""Model weights: locating checkpoints and the tiny random checkpoints shipped for tests and demos."""

from .latte import TINY_LATTE_DIR, resolve_latte
