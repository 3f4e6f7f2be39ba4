"""Comparing a rebuilt checkpoint with the shipped one, on any CPU.

The builders (tools/weights/) draw every weight from a seeded generator, and torch's random kernels give the
same bits only where they are the same kernels: the shipped files were written with the vectorised ones (AVX2 on
the AMD build machine; Intel's AVX512 ones draw the same bits, as measured for issue 31), while the scalar ones
(`ATEN_CPU_CAPABILITY=default`, or a CPU without AVX2) round the normal draws differently in their last bits.
So the rule is:

- where torch runs the kernels the checkpoints were built with (`BUILT_WITH`), a rebuild equals the shipped
  files byte for byte: that is what a builder must reproduce, and any change to what it writes shows;
- on other kernels every non-tensor file is still the same (JSON configs but for the library version stamps,
  tokenizers and every other file byte for byte), and every tensor file has the same names, dtypes, shapes and
  metadata, with values within `TOLERANCE` of the tensor's largest magnitude (measured: 1.2e-6 at most over
  every shipped random checkpoint under `default`, float32 rounding; another seed or init moves them by ~1e-1).

A build repeated on one machine is byte for byte the same on any kernels (the tests that build twice check it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

VERSION_STAMPS = ("_diffusers_version", "transformers_version")
#: torch's CPU capabilities whose kernels wrote the shipped checkpoints (torch.backends.cpu.get_cpu_capability())
BUILT_WITH = frozenset({"AVX2", "AVX512"})
#: on other kernels: |rebuilt - shipped| <= TOLERANCE * max |shipped|, per tensor
TOLERANCE = 1e-5


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by its relative path."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def without_stamps(path: Path) -> dict:
    """A JSON config without the library version stamps (they may differ; the content may not)."""
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in VERSION_STAMPS}


def built_with_these_kernels() -> bool:
    """Does torch run the CPU kernels the shipped checkpoints were built with (so a rebuild is byte-identical)?"""
    import torch

    return torch.backends.cpu.get_cpu_capability() in BUILT_WITH


def assert_same_file(built: Path, shipped: Path) -> None:
    """`built` reproduces `shipped` under the module's rule (the message names the file and the tensor)."""
    if built.suffix == ".json":
        assert without_stamps(built) == without_stamps(shipped), f"{built.name} differs from {shipped}"
    elif built.suffix == ".safetensors" and not built_with_these_kernels():
        _assert_close_tensors(built, shipped)
    else:
        assert built.read_bytes() == shipped.read_bytes(), f"{shipped} differs from its rebuild; rebuild and commit"


def assert_rebuilt(built: Path, shipped: Path, files: list[str] | None = None) -> None:
    """Every file of the `shipped` directory (or the `files` named, relative paths) is reproduced in `built`."""
    if files is None:
        files = sorted(digests(shipped))
        assert sorted(digests(built)) == files, "the rebuild writes other files than the shipped checkpoint's"
    for rel in files:
        assert_same_file(built / rel, shipped / rel)


def _assert_close_tensors(built: Path, shipped: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(built), "pt") as a, safe_open(str(shipped), "pt") as b:
        assert a.metadata() == b.metadata(), f"{shipped}: metadata differs"
        assert sorted(a.keys()) == sorted(b.keys()), f"{shipped}: other tensors"
        for name in a.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{shipped}: {name} is {x.dtype} {tuple(x.shape)}"
            if not x.is_floating_point():
                assert (x == y).all(), f"{shipped}: {name} differs"
                continue
            scale = y.double().abs().max().item()
            error = (x.double() - y.double()).abs().max().item()
            assert error <= TOLERANCE * scale, f"{shipped}: {name} differs by {error:.3g} (largest value {scale:.3g})"
