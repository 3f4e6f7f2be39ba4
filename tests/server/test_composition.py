"""The server's composition root (issue 44): `VideoService` builds its parts in one place and hands each the
narrow collaborators it uses; no part takes the whole service, so none reaches into another through it."""

from __future__ import annotations

import ast
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "server" / "api"


def test_no_server_part_takes_the_whole_service():
    taking = []
    for path in sorted(API.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    (node.name == "__init__" or node.name.startswith("attach")):
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
                if "service" in names:
                    taking.append(f"{path.name}: {node.name}")
    assert not taking, taking
    handed = [ast.unparse(node) for node in ast.walk(ast.parse((API / "service.py").read_text()))
              if isinstance(node, ast.Call) and any(isinstance(a, ast.Name) and a.id == "self"
                                                    for a in [*node.args, *(k.value for k in node.keywords)])]
    assert not handed, handed
