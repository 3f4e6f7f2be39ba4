"""A small Prometheus registry (text exposition format 0.0.4): counters, gauges, histograms.

Hand-written to keep the server free of an extra dependency; thread-safe, since the step
scheduler's thread observes while request handlers render.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = name, help_text, tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help_text, labels=()):
        super().__init__(name, help_text, labels)
        self._values: dict[tuple, float] = {}

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = tuple(str(labels[n]) for n in self.labelnames)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in items]


class Gauge(_Metric):
    """A gauge read from a callback at render time: {label values: value}, or one number."""

    kind = "gauge"

    def __init__(self, name, help_text, read: Callable[[], float | dict], labels=()):
        super().__init__(name, help_text, labels)
        self._read = read

    def render(self) -> list[str]:
        value = self._read()
        items = sorted(value.items()) if isinstance(value, dict) else [((), value)]
        return self.header() + [
            f"{self.name}{_labels(self.labelnames, k if isinstance(k, tuple) else (k,))} {_num(float(v))}"
            for k, v in items]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_text, buckets: tuple[float, ...]):
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value
            self._count += 1

    def render(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self._counts), self._sum, self._count
        lines, cumulative = self.header(), 0
        for bound, c in zip(self.buckets + (math.inf,), counts):
            cumulative += c
            lines.append(f'{self.name}_bucket{{le="{_num(float(bound))}"}} {cumulative}')
        lines += [f"{self.name}_sum {_num(total)}", f"{self.name}_count {count}"]
        return lines


class Registry:
    def __init__(self):
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self._metrics:
            lines += m.render()
        return "\n".join(lines) + "\n"


def parse_text(text: str) -> dict[str, float]:
    """Parse exposition text into {"name{labels}": value} (for tests and `bench serve`)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value.replace("+Inf", "inf"))
    return out
