"""The repository's shape: every source file stays under 600 lines (a module with one job, a test file with one
subject), and the layer diagram at the top of docs/design.md names modules that exist, every model family and
every bench target."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
#: the files allowed past MAX_LINES, each with why (none since the families became declarations, issue 44)
OVER_FOR_NOW: dict[str, str] = {}
SKIPPED = {".venv", ".git", "build", "dist", "node_modules", "__pycache__"}


def source_files() -> list[Path]:
    found = []
    for pattern in ("*.py", "*.sh", "*.js"):
        for path in ROOT.rglob(pattern):
            parts = path.relative_to(ROOT).parts
            if SKIPPED & set(parts) or any(p.startswith("tiny-") or p.endswith(".egg-info") for p in parts):
                continue
            found.append(path)
    return found


def test_no_source_file_is_over_600_lines():
    files = source_files()
    assert len(files) > 200, "the walk found the repository's files"
    long = {p.relative_to(ROOT).as_posix(): n for p in files
            if (n := len(p.read_text(errors="replace").splitlines())) > MAX_LINES}
    assert set(long) <= set(OVER_FOR_NOW), {k: v for k, v in long.items() if k not in OVER_FOR_NOW}


def diagram() -> str:
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("## One engine door")
    return text[text.index("```", start) + 3:text.index("```", text.index("```", start) + 3)]


def diagram_paths() -> set[str]:
    """Every module the diagram names, as a repository path: `engine/x.py`, or a bare `x.py` under the folder
    its line (or the line it continues) starts with."""
    paths, folder = set(), ""
    for line in diagram().splitlines():
        head = re.match(r"^ ((?:[a-z_]+/)*)([a-z_0-9]+)(\.py|/)?\s", line)
        if head:                                   # " server/api  ...", " engine/families/ ...", " engine/core.py ..."
            folder = head.group(1) + ("" if head.group(3) == ".py" else head.group(2) + "/")
        for name in re.findall(r"(?<![\w/.])((?:[a-z_0-9]+/)*[a-z_0-9]+\.py)\b", line):
            rooted = "/" in name and (ROOT / name).exists()          # engine/x.py, or a package's ltx2/api.py
            paths.add(name if rooted else folder + name)
    return paths


def test_the_layer_diagram_names_modules_that_exist():
    paths = diagram_paths()
    assert len(paths) > 30, sorted(paths)
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, missing


def test_the_layer_diagram_names_every_family_model_and_bench_target():
    from longserve.server.cli.bench import BENCHES

    paths = diagram_paths()
    for folder in ("engine/families", "engine/models"):
        modules = {f"{folder}/{p.name}" for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py"}
        assert modules <= paths, sorted(modules - paths)
    packages = [p.name for p in (ROOT / "engine" / "families").iterdir() if (p / "__init__.py").is_file()]
    assert all(re.search(rf"\b{name}/", diagram()) for name in packages), packages   # a declared family's package
    bench_line = next(line for line in diagram().splitlines() if "longserve bench:" in line)
    listed = set(re.findall(r"[a-z][a-z-]*", bench_line.split(":", 1)[1]))
    listed |= set(re.findall(r"[a-z][a-z-]*", diagram().split("longserve bench:", 1)[1].split("(", 1)[0]))
    assert set(BENCHES) <= listed, sorted(set(BENCHES) - listed)
