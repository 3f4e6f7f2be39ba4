"""What `pip install .` ships and how the runtime imports itself: the packages hold runtime code only (the tiny
checkpoints' builders, training and evaluation and their helpers stay in tools/weights/, the benchmarks and the GPU
scripts in tools/, the tests' helpers in tests/), and no
runtime module imports another that (directly or through others) imports it back."""

from __future__ import annotations

import ast
import glob
import re
import runpy
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("engine", "pipelines", "server", "weights")      # the repository's folders, `longserve.<folder>` installed
DEV_MODULE = re.compile(r"^(build|train|eval)_")


def setuptools_config() -> dict:
    """pyproject.toml's settings, with the packages setup.py finds."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {**config, "packages": runpy.run_path(str(ROOT / "setup.py"), run_name="setup")["packages"]()}


def package_folder(package: str, package_dir: dict) -> Path:
    """Where a package's files are in the repository, by pyproject's package-dir (longserve.engine -> engine/)."""
    for prefix in sorted(package_dir, key=len, reverse=True):
        if package == prefix or package.startswith(prefix + "."):
            return ROOT / package_dir[prefix] / package[len(prefix) + 1:].replace(".", "/")
    return ROOT / package.replace(".", "/")


def shipped_files() -> list[str]:
    """The files a wheel gets, as installed paths (longserve/engine/...), from pyproject.toml's settings (the same list
    as the built wheel's, which takes 5-15 s to build): every module of every listed package, and the package data."""
    config = setuptools_config()
    files = []
    for package in config["packages"]:
        folder = package_folder(package, config["package-dir"])
        files += [f"{package.replace('.', '/')}/{p.name}" for p in folder.glob("*.py")]
    for package, patterns in config["package-data"].items():
        folder = package_folder(package, config["package-dir"])
        for pattern in patterns:            # glob.glob, as setuptools: it follows the DF variants' linked folders
            found = glob.glob(str(folder / pattern), recursive=True)
            files += [f"{package.replace('.', '/')}/{Path(p).relative_to(folder).as_posix()}" for p in found
                      if Path(p).is_file()]
    return sorted(set(files))


def test_one_top_level_name_holding_runtime_code_and_the_shipped_checkpoints_only():
    config = setuptools_config()
    listed = set(config["packages"])
    folders = {"longserve." + ".".join(p.parent.relative_to(ROOT).parts)
               for top in RUNTIME for p in (ROOT / top).rglob("__init__.py") if "/tiny-" not in p.as_posix()}
    assert folders <= listed, f"package folders missing from pyproject's packages: {sorted(folders - listed)}"
    files = shipped_files()
    modules = [f for f in files if f.endswith(".py")]
    assert {f.split("/")[0] for f in files} == {"longserve"}, "installing longserve adds exactly one top-level name"
    assert {f.split("/")[1] for f in files if f.count("/") > 1} == set(RUNTIME)
    assert not [f for f in modules if DEV_MODULE.match(Path(f).name)], "builders/training/evaluation are tools/"
    assert not [f for f in modules if "/tiny-" in f]
    assert {"longserve/__init__.py", "longserve/weights/registry.py", "longserve/server/cli/__init__.py",
            "longserve/server/cli/bench.py"} <= set(files)
    assert "longserve/weights/tiny-latte/model_index.json" in files and \
        "longserve/weights/tiny-lm/model.safetensors" in files


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
    """Every runtime module (its installed dotted name, longserve.engine.worker) -> what it imports."""
    found = {"longserve": imports_of(ROOT / "longserve" / "__init__.py", "longserve")}
    for top in RUNTIME:
        for path in (ROOT / top).rglob("*.py"):
            if "/tiny-" not in path.as_posix():
                parts = ("longserve", *path.relative_to(ROOT).with_suffix("").parts)
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

    def layer_of(module: str) -> int:           # longserve itself (its lazy exports) sits above every layer
        parts = module.split(".")
        return layer[parts[1]] if len(parts) > 1 else len(layer)

    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))
    assert not upward, upward
    dev = sorted(f"{m} -> {n}" for m, names in imports.items() for n in names if n.split(".")[0] in ("tools", "tests"))
    assert not dev, dev


def test_every_rebuild_command_the_registry_names_is_a_script_in_tools_weights():
    from longserve.weights.registry import REBUILD_COMMANDS, TINY_MODELS

    assert set(REBUILD_COMMANDS) == set(TINY_MODELS)
    for name, command in REBUILD_COMMANDS.items():
        words = command.split()
        assert words[:3] == ["python", "-m", words[2]] and words[2].startswith("tools.weights."), name
        script = ROOT / (words[2].replace(".", "/") + ".py")
        assert script.is_file(), (name, command)
        if "--kind" in words:
            assert f'"{words[words.index("--kind") + 1]}"' in script.read_text(), (name, command)


def test_the_wheel_holds_no_benchmark_nor_gpu_script_and_the_bench_command_says_where_they_are(monkeypatch, capsys):
    """Issue 44: the wheel's file list (pyproject's packages and package-dir, as setuptools builds it) holds the
    runtime: no benchmark module (they are a clone's tools/bench/), no GPU session script, none of the weight
    builders' helpers (published configs, seeded redraws, the procedural prompts: tools/weights/). From a clone
    `longserve bench` finds them; without one it says what to do, and exits 2."""
    files = shipped_files()
    assert not [f for f in files if "/bench/" in f or Path(f).name.startswith("gpu") or f.endswith(".sh")], files
    assert not {"longserve/weights/wan.py", "longserve/weights/seeded.py", "longserve/weights/prompts.py"} & \
        set(files)
    assert (ROOT / "tools" / "bench" / "gpu.py").is_file() and (ROOT / "tools" / "weights" / "seeded.py").is_file()
    from longserve.server.cli import bench, main

    assert bench.clone_root() == ROOT
    monkeypatch.setattr(bench, "clone_root", lambda: None)
    assert main(["bench", "gpu", "--smoke"]) == 2
    assert "from a clone of the repository" in capsys.readouterr().err


def test_the_image_copies_what_the_build_reads_and_every_source_folder():
    """`pip install .` in the Dockerfile builds from what its COPY lines brought: pyproject.toml, setup.py (which
    finds the packages), the readme and every source folder setup.py walks."""
    from dockerfile import instructions

    copied = {src.rstrip("/") for word, rest in instructions() if word == "COPY" and not rest.startswith("--from")
              for src in rest.split()[:-1]}
    sources = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")["SOURCES"].values()
    missing = {"pyproject.toml", "setup.py", "README.md", *sources} - copied
    assert not missing, f"the Dockerfile does not copy {sorted(missing)}"
