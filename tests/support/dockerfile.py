"""The Dockerfile and README's docker line as data, for tests without a Docker engine (tests/server/test_docker.py,
tests/server/test_deploy.py)."""

import json
import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def instructions():
    """[(INSTRUCTION, argument text)] with line continuations joined and comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def docker_run_argv(image_args: list[str]) -> list[str]:
    """The command a container runs for `docker run IMAGE ARGS...`: ENTRYPOINT + ARGS, or ENTRYPOINT + CMD without
    ARGS (Docker's rule; no Docker engine runs here, so the rule is applied to the Dockerfile's own lines)."""
    ins = dict(instructions())
    return json.loads(ins["ENTRYPOINT"]) + (image_args or json.loads(ins["CMD"]))


def readme_docker_line() -> list[str]:
    """The arguments after the image name in README.md's `docker run ... longserve:latest ...` line."""
    text = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    line = re.search(r"`(docker run [^`]*)`", text).group(1)
    words = shlex.split(line)
    return words[words.index("longserve:latest") + 1:]
