"""What `pip install .` ships and how the runtime imports itself: the packages hold runtime code only (the tiny
checkpoints' builders, training and evaluation stay in tools/weights/, the tests' helpers in tests/), and no
runtime module imports another that (directly or through others) imports it back."""

from __future__ import annotations

import ast
import glob
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("engine", "pipelines", "server", "weights")
DEV_MODULE = re.compile(r"^(build|train|eval)_")


def shipped_files() -> list[str]:
    """The files a wheel gets, as setuptools finds them with pyproject.toml's settings (the same list as the built
    wheel's, which takes 5-15 s to build): every module of every package found, and the package data."""
    from setuptools import find_namespace_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    files = []
    for package in find_namespace_packages(where=str(ROOT), include=config["packages"]["find"]["include"]):
        folder = ROOT / package.replace(".", "/")
        files += [p.relative_to(ROOT).as_posix() for p in folder.glob("*.py")]
    for package, patterns in config["package-data"].items():
        for pattern in patterns:            # glob.glob, as setuptools: it follows the DF variants' linked folders
            found = glob.glob(str(ROOT / package / pattern), recursive=True)
            files += [Path(p).relative_to(ROOT).as_posix() for p in found if Path(p).is_file()]
    return sorted(set(files))


def test_the_installed_packages_hold_runtime_code_and_the_shipped_checkpoints_only():
    files = shipped_files()
    modules = [f for f in files if f.endswith(".py")]
    assert {f.split("/")[0] for f in files} == set(RUNTIME)
    assert not [f for f in modules if DEV_MODULE.match(Path(f).name)], "builders/training/evaluation are tools/"
    assert not [f for f in modules if "/tiny-" in f]
    assert {"weights/registry.py", "weights/seeded.py", "weights/prompts.py", "server/cli/__init__.py"} <= set(files)
    assert "weights/tiny-latte/model_index.json" in files and "weights/tiny-lm/model.safetensors" in files


def imports_of(path: Path, module: str) -> set[str]:
    """Every module `module` imports, at its top or inside a function (a lazy import closes a circle too)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                             # from .x import y: relative to the module's package
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def runtime_imports() -> dict[str, set[str]]:
    """Every runtime module (dotted name) -> what it imports."""
    found = {}
    for top in RUNTIME:
        for path in (ROOT / top).rglob("*.py"):
            if "/tiny-" not in path.as_posix():
                parts = path.relative_to(ROOT).with_suffix("").parts
                module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[module] = imports_of(path, module)
    return found


def import_graph(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> the runtime modules importing it runs: importing a.b.c runs a/__init__ and a/b/__init__ too,
    except the packages the importer is itself inside (they are already running)."""
    graph = {}
    for module, names in imports.items():
        ancestors = {module.rsplit(".", i)[0] for i in range(module.count(".") + 1)}
        targets = set()
        for name in names:
            parts = name.split(".")
            targets |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & imports.keys()
        graph[module] = targets - ancestors
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in `graph` (depth-first search), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_runtime_module_imports_itself_back_nor_upwards_nor_dev_tooling():
    imports = runtime_imports()
    graph = import_graph(imports)
    assert cycle(graph) is None, " -> ".join(cycle(graph))
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]     # the check can fail
    layer = {top: i for i, top in enumerate(("weights", "engine", "pipelines", "server"))}
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if layer[t.split(".")[0]] > layer[m.split(".")[0]])
    assert not upward, upward
    dev = sorted(f"{m} -> {n}" for m, names in imports.items() for n in names if n.split(".")[0] in ("tools", "tests"))
    assert not dev, dev


def test_every_rebuild_command_the_registry_names_is_a_script_in_tools_weights():
    from weights.registry import REBUILD_COMMANDS, TINY_MODELS

    assert set(REBUILD_COMMANDS) == set(TINY_MODELS)
    for name, command in REBUILD_COMMANDS.items():
        words = command.split()
        assert words[:3] == ["python", "-m", words[2]] and words[2].startswith("tools.weights."), name
        script = ROOT / (words[2].replace(".", "/") + ".py")
        assert script.is_file(), (name, command)
        if "--kind" in words:
            assert f'"{words[words.index("--kind") + 1]}"' in script.read_text(), (name, command)
