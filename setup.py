"""The installed packages, found rather than listed: every folder with an `__init__.py` under the source folders,
named `longserve.<folder>...` (pyproject.toml's package-dir maps the names back). A new family package
(`engine/families/<name>/`) ships with no line here or in pyproject.toml; everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
SOURCES = {"longserve": "longserve", "longserve.engine": "engine", "longserve.pipelines": "pipelines",
           "longserve.server": "server", "longserve.weights": "weights"}


def packages() -> list[str]:
    found = []
    for name, folder in SOURCES.items():
        for init in sorted((HERE / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(HERE / folder)
            if not any(part.startswith(("tiny-", "__pycache__")) for part in rel.parts):
                found.append(".".join([name, *rel.parts]))
    return found


if __name__ == "__main__":
    setup(packages=packages())
