"""The README's Python snippets run as a user runs them: saved to a file, with no main guard, in a fresh process; every
line that states a value (`out.frames.shape   # (1, 17, 64, 64, 3)`) prints it, and the printed value must be the one
stated. The OpenAI-client snippet needs a server and is run by tests/server (the same calls, in-process)."""

from __future__ import annotations

import ast
import keyword
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: a line that is a bare expression (attributes, names, tuples of them), with what the README says of it
CLAIM = re.compile(r"^(?P<indent>\s*)(?P<expr>[A-Za-z_][\w.]*(\s*,\s*[A-Za-z_][\w.]*)*)\s*(#\s*(?P<said>.*))?$")


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def instrumented(code: str) -> tuple[str, dict[int, str]]:
    """`code` with each claim line printing its value (tagged with its line number), and what each line says."""
    lines, said = [], {}
    for number, line in enumerate(code.splitlines(), 1):
        m = CLAIM.match(line)
        if m and not keyword.iskeyword(m["expr"].split(".")[0]):
            said[number] = m["said"] or ""
            line = f"{m['indent']}print('README-CLAIM', {number}, repr(({m['expr']})), flush=True)"
        lines.append(line)
    return "\n".join(lines) + "\n", said


def stated(said: str):
    """The value a comment states (its leading Python literal; names in a tuple, as `T_i`, stand for any value),
    or None when it states none."""
    m = re.match(r"[(\[{].*?[)\]}](?=[:,;]|\s|$)", said)
    if not m:
        return None
    text = re.sub(r"(?<![\"'\w])[A-Za-z_][^,()]*", "...", m.group(0))     # a name, or an expression of one
    try:
        return ast.literal_eval(text.replace("...", "None"))
    except (ValueError, SyntaxError):
        return None


def matches(value, expected) -> bool:
    if expected is None:
        return True
    if isinstance(expected, tuple):
        return isinstance(value, tuple) and len(value) == len(expected) and all(
            matches(v, e) for v, e in zip(value, expected))
    return value == expected


def test_the_claim_reader_reads_the_readme_s_notation():
    assert stated("(1, 17, 64, 64, 3), float32 in [0, 1]") == (1, 17, 64, 64, 3)
    assert stated("(T_i, 64, 64, 3): one segment's final frames") == (None, 64, 64, 3)
    assert stated("(1, T + 25 - 9, 64, 64, 3)") == (1, None, 64, 64, 3)
    assert stated('[{"name": "style", "scale": 0.8}]') == [{"name": "style", "scale": 0.8}]
    assert stated("a chunk's frames") is None
    assert matches((1, 5, 64), (1, None, 64)) and not matches((1, 5, 64), (2, None, 64))


#: runs each snippet file as `__main__` in turn (runpy, as `python FILE` does), in one process: one interpreter and
#: one fork server for all of them (their start is most of this test's time)
DRIVER = """
import runpy, sys
for path in sys.argv[1:]:
    print("README-SNIPPET", path, flush=True)
    runpy.run_path(path, run_name="__main__")
"""


def test_the_readme_snippets_run_as_files_with_no_main_guard_and_print_what_they_say(tmp_path):
    """Each snippet is a file run as `__main__` (no `if __name__ == "__main__":`; the workers must not re-run it),
    one after the other in one fresh process, in an empty directory: they make their own inputs (issue 46)."""
    snippets = [s for s in python_snippets() if "from openai" not in s]
    assert not re.search(r"open\(\s*[\"'][^\"']+\.(png|jpg|mp4|txt)", "\n".join(snippets)), \
        "the snippets make their inputs (issue 46: cat.png, ship.mp4 and book.txt existed nowhere)"
    assert len(snippets) >= 2
    paths, claims = [], []
    for i, code in enumerate(snippets):
        script, said = instrumented(code)
        assert said, f"snippet {i} states nothing"
        paths.append(tmp_path / f"snippet{i}.py")
        paths[-1].write_text(script)
        claims.append(said)
    run = subprocess.run([sys.executable, "-c", DRIVER, *map(str, paths)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-4000:]}"
    outputs = run.stdout.split("README-SNIPPET ")[1:]
    assert len(outputs) == len(snippets), run.stdout
    check_claims(snippets, claims, outputs)


def check_claims(snippets, claims, outputs) -> None:
    for i, (code, said, out) in enumerate(zip(snippets, claims, outputs)):
        printed = [line.split(" ", 2) for line in out.splitlines() if line.startswith("README-CLAIM ")]
        seen = {int(number) for _, number, _ in printed}
        assert seen == set(said), f"snippet {i}: lines {sorted(set(said) - seen)} never ran"
        for _, number, value in printed:
            expected = stated(said[int(number)])
            if expected is not None:
                assert matches(ast.literal_eval(value), expected), \
                    f"snippet {i}, line {number}: {code.splitlines()[int(number) - 1].strip()!r} printed {value}"


def test_the_readme_s_model_list_and_the_help_texts_come_from_the_registry_and_the_subcommands(capsys):
    """Issue 36: tiny-live was missing from the README's list, `--model`'s help named three models, and `longserve
    --help` left out bench targets. The help texts are built from weights.TINY_MODELS and bench's BENCHES; the
    README's list must name exactly the shipped checkpoints (and tiny-lm, the scoring model)."""
    from longserve.server.cli import build_parser
    from longserve.server.cli.bench import BENCHES
    from longserve.weights import TINY_MODELS
    from longserve.weights.lm import TINY_LM

    text = (ROOT / "README.md").read_text()
    listed = re.search(r"`weights/` ships tiny\s+checkpoints \((.*?)\)\.", text, re.S)
    assert listed, "README: the sentence listing the shipped checkpoints"
    assert re.findall(r"`(tiny-[\w-]+)`", listed.group(1)) == [*TINY_MODELS, TINY_LM]
    from longserve.weights import TRAINED_MODELS

    for name in TINY_MODELS:                # issue 46: the random ones are marked wherever models are listed
        entry = re.search(rf"`{name}`(\s+\([^)]*\))?", listed.group(1)).group(1) or ""
        assert ("random" in entry) == (name not in TRAINED_MODELS), (name, entry)
    parser = build_parser()
    top = parser.format_help()
    assert all(name in top for name in BENCHES), top
    generate = parser._subparsers._group_actions[0].choices["generate"].format_help()
    assert all(name in " ".join(generate.split()).replace("- ", "-") for name in TINY_MODELS), generate


def test_the_readme_s_http_quick_start_runs_as_written_and_draws_a_red_ball_bouncing(tmp_path, monkeypatch):
    """Issue 46: the HTTP quick start served tiny-wan (random weights: its "red ball" was coloured noise). The
    README's `longserve serve` line is parsed by serve's own parser and served in this process (its port taken from
    a free one: the one thing changed); the client block runs as a script against it, and its MP4 must show a red
    ball bouncing (the procedural clips' recogniser, tests/support/content.py)."""
    import shlex

    import imageio.v3 as iio
    from content import recognises

    from longserve.server.api.app import free_port, serve_in_thread
    from longserve.server.cli import build_parser
    from longserve.server.cli.serve import build

    text = (ROOT / "README.md").read_text().split("### HTTP server", 1)[1]
    line = re.search(r"```bash\n(longserve serve [^\n]*)\n```", text).group(1)
    argv = shlex.split(line.split("#", 1)[0])
    [client] = [s for s in python_snippets() if "from openai" in s]
    monkeypatch.chdir(tmp_path)                      # its data dir (the default, relative) lands here
    args = build_parser().parse_args(argv[1:])
    assert args.model == "tiny-latte"
    videos, score, app = build(args)
    try:
        with serve_in_thread(app, port=free_port()) as url:
            script, said = instrumented(client.replace(f"http://{args.host}:{args.port}", url))
            (tmp_path / "client.py").write_text(script)
            run = subprocess.run([sys.executable, "client.py"], cwd=tmp_path, capture_output=True, text=True,
                                 timeout=300)
    finally:
        videos.close()
        if score is not None:
            score.close()
    assert run.returncode == 0, run.stderr[-4000:]
    check_claims([client], [said], [run.stdout])
    clip = iio.imread(tmp_path / "ball.mp4", extension=".mp4")
    assert clip.shape == (16, 64, 64, 3) and recognises(clip, "a red ball bouncing")
    assert iio.imread(tmp_path / "ball_frames.png").shape == (4 * 64, 5 * 64, 3)     # 16 frames, 5 a row
