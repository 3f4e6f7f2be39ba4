"""Writing a checkpoint directory: whole or not at all, readable like package data, and what its files hash to.

Every builder and trainer in tools/weights/ writes through `write_whole`, so an interrupted run never leaves a
half-written checkpoint in weights/ (the runtime would find and load it).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_whole(out: str | Path, write: Callable[[Path], None], *, resolve: bool = True,
                normalise: bool = True) -> Path:
    """Run ``write(tmp)`` into a temporary sibling of ``out`` and swap it in; return ``out``.

    An existing ``out`` is only replaced if it is empty or looks like a pipeline directory (has
    model_index.json): anything else is refused rather than deleted. ``resolve=False`` keeps ``out``'s symlinks
    in its path (a directory of links beside their targets); ``normalise=False`` leaves the permissions as
    written (``normalise_permissions`` would follow dangling links).
    """
    out = Path(out).resolve() if resolve else Path(out).absolute()
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"{out} exists and is not a directory")
        if any(out.iterdir()) and not (out / "model_index.json").is_file():
            raise FileExistsError(f"refusing to overwrite {out}: it is not empty and has no model_index.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        if normalise:
            normalise_permissions(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def normalise_permissions(root: Path) -> None:
    # mkdtemp makes a 0700 directory and some savers write 0600 files; make the checkpoint
    # readable like any other package data (0755 directories, 0644 files).
    root.chmod(0o755)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


def file_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative posix path -> hex digest)."""
    root = Path(root)
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def report(out: Path, seconds: float, **fields) -> None:
    """What a builder prints: the digest of every weights file it wrote, then one JSON line of totals."""
    import json

    digests = file_digests(out)
    for rel, digest in digests.items():
        if rel.endswith(".safetensors"):
            print(f"{digest}  {rel}")
    total = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
    print(json.dumps({**fields, "out": str(out), "files": len(digests), "bytes": total, "seconds": round(seconds, 2)}))


def build_kind(writers: dict, kind: str, out: str | Path | None = None) -> Path:
    """Write the checkpoint `writers[kind]` = (shipped name, writer) makes: to `out`, or over the shipped one."""
    from longserve.weights.registry import TINY_MODELS

    name, write = writers[kind]
    return write_whole(TINY_MODELS[name] if out is None else out, write)


def kinds_main(prog: str, description: str, writers: dict, build: Callable, argv: list[str] | None = None) -> int:
    """The command line of a builder that writes several shipped checkpoints (`--kind`, `--out`): each it writes,
    reported."""
    import argparse
    import time

    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--kind", choices=sorted(writers), default=None, help="one checkpoint (default: both)")
    ap.add_argument("--out", default=None, help="output directory (default: the shipped one; needs --kind)")
    args = ap.parse_args(argv)
    if args.out is not None and args.kind is None:
        ap.error("--out needs --kind")
    for kind in [args.kind] if args.kind else sorted(writers, reverse=True):
        t0 = time.perf_counter()
        report(build(kind, args.out), time.perf_counter() - t0, kind=kind)
    return 0
