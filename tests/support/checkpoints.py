"""Comparing a rebuilt checkpoint with the shipped one: every file's digest, JSON configs without library stamps."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

VERSION_STAMPS = ("_diffusers_version", "transformers_version")


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by its relative path."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def without_stamps(path: Path) -> dict:
    """A JSON config without the library version stamps (they may differ; the content may not)."""
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in VERSION_STAMPS}
