"""Shared output helpers for `longserve bench` targets: machine, tables, JSON, plots, docs.

A benchmark produces a list of flat dict rows (one per measured configuration). These
helpers turn the rows into what every benchmark reports: a JSON file, a text table for
the terminal, the same table in markdown, a PNG of line plots, and its own section of
docs/benchmarks.md. Nothing here imports torch or matplotlib at module level, so
`longserve --help` stays instant.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


def machine_info(device: str = "cpu") -> dict:
    """What a number was measured on: CPU model, cores, torch version, backend (and GPU if any)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "device": device,
        "backend": "nccl" if device.startswith("cuda") else "gloo",
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (other processes sharing the cores skew timings)."""
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def _busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat), or None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(v) for v in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _process_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process (all its threads), 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """How much CPU *other* processes used while a benchmark ran: a contamination check.

    `start(pids)` and `stop()` bracket the measured region; `pids` are the benchmark's own
    processes (coordinator and workers). `fraction` = other processes' busy CPU seconds
    over the machine's core-seconds in that interval (0: the benchmark had the machine to
    itself; 0.5 on 2 cores: another process kept one core busy). None where /proc is absent.
    """

    def __init__(self) -> None:
        self.fraction: float | None = None

    def start(self, pids: list[int]) -> "ForeignLoad":
        self.pids = list(pids)
        self._t = time.monotonic()
        self._busy = _busy_cpu_seconds()
        self._mine = sum(_process_cpu_seconds(p) for p in self.pids)
        return self

    def stop(self) -> float | None:
        busy = _busy_cpu_seconds()
        if busy is None or self._busy is None:
            return None
        mine = sum(_process_cpu_seconds(p) for p in self.pids) - self._mine
        wall = time.monotonic() - self._t
        others = max(0.0, (busy - self._busy) - mine)
        self.fraction = others / (wall * (os.cpu_count() or 1)) if wall > 0 else None
        return self.fraction


def int_list(text: str, name: str) -> list[int]:
    """Parse a comma-separated list of positive integers; `name` is the option, for the error."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name}: expected positive integers, got {text!r}")
    return values


def write_json(rows: list[dict], path: str | os.PathLike) -> None:
    """Write the rows as a JSON list (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2) + "\n")


# -- tables ---------------------------------------------------------------------------


@dataclass
class Column:
    """One table column: a header, and a row key or a function of the row; `fmt` formats the value."""

    header: str
    value: str | Callable[[dict], Any]
    fmt: str | Callable[[Any], str] | None = None

    def cell(self, row: dict) -> str:
        v = row.get(self.value) if isinstance(self.value, str) else self.value(row)
        if v is None:
            return "-"
        if callable(self.fmt):
            return self.fmt(v)
        if self.fmt:
            return format(v, self.fmt)
        return format_value(v)


def format_value(v: Any) -> str:
    """A readable default: 3 significant digits for floats, `k: v, ...` for dicts."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if v == 0 or math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {format_value(x)}" for k, x in sorted(v.items())) or "-"
    return str(v)


def _columns(columns: Sequence[Column | str | tuple]) -> list[Column]:
    out = []
    for c in columns:
        if isinstance(c, Column):
            out.append(c)
        elif isinstance(c, str):
            out.append(Column(c, c))
        else:
            out.append(Column(*c))
    return out


def _is_numeric(rows: list[dict], col: Column) -> bool:
    vals = [row.get(col.value) if isinstance(col.value, str) else col.value(row) for row in rows]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals if v is not None)


def markdown_table(rows: list[dict], columns: Sequence[Column | str | tuple]) -> str:
    """A GitHub markdown table; columns are `Column`s, row keys, or (header, key_or_fn[, fmt]) tuples.

    Numeric columns are right-aligned.
    """
    cols = _columns(columns)
    lines = ["| " + " | ".join(c.header for c in cols) + " |",
             "|" + "|".join("---:" if _is_numeric(rows, c) else "---" for c in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(c.cell(row) for c in cols) + " |")
    return "\n".join(lines)


def text_table(rows: list[dict], columns: Sequence[Column | str | tuple]) -> str:
    """The same table, space-aligned for a terminal."""
    cols = _columns(columns)
    cells = [[c.header for c in cols]] + [[c.cell(row) for c in cols] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    numeric = [_is_numeric(rows, c) for c in cols]

    def line(r):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(r, widths, numeric)).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


# -- plots ----------------------------------------------------------------------------


@dataclass
class Panel:
    """One subplot: `y` (row key) against the plot's x key, one line per group; `scale` divides y."""

    y: str
    ylabel: str
    title: str = ""
    scale: float = 1.0
    log_y: bool = False


def plot_lines(
    rows: list[dict],
    path: str | os.PathLike,
    x: str,
    panels: Sequence[Panel],
    group: str,
    title: str = "",
    xlabel: str | None = None,
    hlines: dict[int, list[tuple[float, str]]] | None = None,
) -> None:
    """Save a PNG with one panel per `Panel`: y vs `x`, one marked line per value of `group`.

    `hlines` maps a panel index to horizontal reference lines [(y, label), ...] (already scaled).
    Rows whose y is None are skipped.
    """
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'longserve[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    groups = list(dict.fromkeys(r[group] for r in rows))
    xs = sorted({r[x] for r in rows})
    for i, (ax, panel) in enumerate(zip(axes[0], panels)):
        for j, g in enumerate(groups):
            pts = sorted((r[x], r[panel.y] / panel.scale) for r in rows if r[group] == g and r.get(panel.y) is not None)
            if pts:
                # later groups get smaller markers, so equal values stay visible one over the other
                ax.plot(*zip(*pts), marker="os^vDP*X"[j % 8], markersize=max(4.0, 9.0 - 1.5 * j),
                        color=f"C{j}", label=str(g))
        for k, (yv, label) in enumerate((hlines or {}).get(i, [])):
            ax.axhline(yv, color="grey", linestyle=":" if k == 0 else "--", linewidth=1, label=label)
        ax.set_xlabel(xlabel or x)
        ax.set_ylabel(panel.ylabel)
        if panel.title:
            ax.set_title(panel.title, fontsize=10)
        if panel.log_y:
            ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- docs -----------------------------------------------------------------------------


def replace_markdown_section(path: str | os.PathLike, heading: str, body: str) -> None:
    """Replace the `heading` section ("## ...", up to the next "## " or the end) of a markdown
    file with `heading` + `body`, or append it; every other section is left as it is."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = heading.rstrip() + "\n\n" + body.strip("\n") + "\n"
    pattern = re.compile(rf"^{re.escape(heading.rstrip())}[ \t]*\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")
