"""The Dockerfile, checked without a Docker engine: what it copies exists (and is not ignored), what it
installs is declared, its entrypoint is the declared console script, its default command parses."""

import fnmatch
import re
import shlex
from pathlib import Path

from dockerfile import docker_run_argv, instructions, pyproject, readme_docker_line

ROOT = Path(__file__).resolve().parents[2]


def ignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p) for p in patterns)


def test_the_base_image_is_cuda_pytorch():
    ins = instructions()
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    base = next(a for k, a in ins if k == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert base.startswith("pytorch/pytorch:") and "cuda" in base and "runtime" in base, base


def test_every_copied_path_exists_is_not_dockerignored_and_covers_the_packages():
    copied = []
    for kind, arg in instructions():
        if kind == "COPY":
            *sources, _dest = shlex.split(arg)
            for src in sources:
                assert not src.startswith("--"), "no --from/--chown copies expected"
                assert (ROOT / src).exists(), f"COPY {src}: missing"
                assert not ignored(src), f"COPY {src}: excluded by .dockerignore"
                copied.append(src.rstrip("/"))
    meta = pyproject()
    for package, folder in meta["tool"]["setuptools"]["package-dir"].items():
        assert folder in copied, f"package {package} ({folder}/) is installed but not copied"
    assert meta["project"]["readme"] in copied, "setuptools needs the readme to build"
    assert "pyproject.toml" in copied


def test_it_installs_the_declared_gpu_extra():
    runs = " ".join(a for k, a in instructions() if k == "RUN")
    extras = re.findall(r"pip install [^&]*?'\.\[([\w,]+)\]'", runs)
    assert extras, "the image should pip install the project with an extra"
    declared = pyproject()["project"]["optional-dependencies"]
    for extra in extras[0].split(","):
        assert extra in declared, f"extra {extra!r} is not declared in pyproject.toml"
    assert any(dep.startswith("xformers") for dep in declared["gpu"])


def test_the_entrypoint_is_the_declared_console_script_and_the_default_command_parses():
    from longserve.server.cli import COMMANDS, build_parser

    argv = docker_run_argv([])
    assert argv[:2] == ["longserve", "serve"]
    assert pyproject()["project"]["scripts"]["longserve"] == "longserve.server.cli:main"
    assert COMMANDS["serve"][0] == "longserve.server.cli.serve"
    args = build_parser().parse_args(argv[1:])
    assert args.model.startswith("/models/") and args.host == "0.0.0.0" and args.device == "cuda"
    assert args.dtype == "bfloat16", "a GPU deployment serves in bf16 by default"


def test_the_readme_s_docker_line_runs_bf16_with_an_absolute_data_dir_the_container_user_owns():
    """README.md's line passes arguments after the image name, which replace CMD: the entrypoint must keep bf16 and
    the data dir (before, they were in CMD, and that line served float32 into a relative, root-owned directory)."""
    from longserve.server.cli import build_parser

    image_args = readme_docker_line()
    assert "--model" in image_args and "bf16 by default" in (ROOT / "README.md").read_text()
    args = build_parser().parse_args(docker_run_argv(image_args)[1:])
    assert args.dtype == "bfloat16" and args.device == "cuda"
    assert args.model == image_args[image_args.index("--model") + 1] and args.workers == 4
    assert args.data_dir == "/data", args.data_dir
    setup = next(a for k, a in instructions() if k == "RUN" and "useradd" in a)
    assert "--uid 10001" in setup and "chown longserve:longserve /data" in setup
    assert ("USER", "longserve") in instructions()


def test_make_docker_builds_the_image_the_dockerfile_documents():
    recipe = re.search(r"^docker:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile has a docker target"
    assert recipe.group(1).strip() == "docker build -t longserve:latest ."
    header = (ROOT / "Dockerfile").read_text().split("ARG ", 1)[0]
    assert "make docker" in header and "longserve:latest" in header


def test_the_gpu_image_installs_no_benchmark_only_dependency():
    meta = pyproject()["project"]
    core = [d.split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in meta["dependencies"]]
    assert "matplotlib" not in core and "matplotlib" in " ".join(meta["optional-dependencies"]["bench"])
    runs = " ".join(a for k, a in instructions() if k == "RUN")
    assert "bench" not in re.findall(r"'\.\[([\w,]+)\]'", runs)[0]


def test_the_server_runs_as_an_unprivileged_user_owning_a_private_data_dir():
    ins = instructions()
    kinds = [k for k, _ in ins]
    users = [a for k, a in ins if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image should not run as root"
    user = users[-1].split(":")[0]
    setup = next((a for k, a in ins if k == "RUN" and "/data" in a), "")
    assert "useradd" in setup and f"chown {user}:{user} /data" in setup and "chmod 0700 /data" in setup, setup
    # the data dir is made and the user switched to after the install (pip runs as root) and before the volume
    assert kinds.index("USER") > max(i for i, (k, a) in enumerate(ins) if k == "RUN" and "pip install" in a)
    assert kinds.index("USER") < kinds.index("VOLUME") and kinds.index("ENTRYPOINT") > kinds.index("USER")


def test_the_dockerfile_documents_keys_from_the_environment_or_a_file_never_the_command_line():
    text = (ROOT / "Dockerfile").read_text()
    header = text.split("ARG ", 1)[0]
    assert "LONGSERVE_API_KEY=" in header and "LONGSERVE_API_KEY_FILE=" in header
    assert "--api-key" not in docker_run_argv([])


def test_the_stop_timeout_the_image_and_the_docs_give_leaves_room_for_the_drain():
    """SIGTERM drains for up to --drain-seconds, then the server stops: the stop timeout the Dockerfile and
    docs/serving.md tell operators to set (docker --stop-timeout, compose stop_grace_period) must exceed it."""
    from longserve.server.api.config import DEFAULT_DRAIN_S

    ins = instructions()
    assert ("STOPSIGNAL", "SIGTERM") in ins
    dockerfile = (ROOT / "Dockerfile").read_text()
    docs = (ROOT / "docs" / "serving.md").read_text()
    for text in (dockerfile, docs):
        [timeout] = set(re.findall(r"--stop-timeout (\d+)", text))
        assert f"stop_grace_period: {timeout}s" in text
        assert int(timeout) >= DEFAULT_DRAIN_S + 10, "drain, then failing the rest and stopping the workers"
