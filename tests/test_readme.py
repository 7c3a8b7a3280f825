"""The README runs as written: Python blocks, section links, lmjax and benchmark commands."""

import pathlib
import re
import shlex
import subprocess
import sys

from lmjax import cli

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has a Python tour"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "max |custom VJP - jax.grad|" in printed
    assert "(2, 4, 2, 8) (2, 2, 4, 4)" in printed
    assert "blocks.0.attention.query.bias" in printed
    assert "(2, 64, 65) 24800" in printed
    assert "steps 3 loss" in printed
    assert "[True, True]" in printed  # the generate tour


def test_readme_names_the_two_commands_that_the_makefile_defines():
    text = README.read_text()
    makefile = (README.parent / "Makefile").read_text()
    for target in ("demo", "test"):
        assert f"make {target}" in text
        assert re.search(rf"^{target}:", makefile, re.M)


def _shell_blocks(text: str) -> list[str]:
    """Command lines of the ```bash blocks and of the `$ ` lines of plain blocks, with
    backslash continuations joined."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += [m.group(1) for m in re.finditer(r"^\$ (.*)$", text, re.M)]
    return [line for line in (shlex.split(raw, comments=True) for raw in lines) if line]


def test_readme_links_to_its_own_sections_resolve():
    """Every `(#anchor)` link names a heading, as GitHub spells anchors (lower case, spaces to
    '-', punctuation other than '-' dropped)."""
    text = README.read_text()
    anchors = {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.*)$", text, re.M)
    }
    links = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert links, "the README links to its sections"
    assert links <= anchors, sorted(links - anchors)
    # Links into docs/ name files that exist, and their #anchors headings of those files.
    for path, anchor in re.findall(r"\]\((docs/[^)#]+)#?([^)]*)\)", text):
        target = README.parent / path
        assert target.is_file(), path
        headings = re.findall(r"^#+ (.*)$", target.read_text(), re.M)
        spelled = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
        assert not anchor or anchor in spelled, (path, anchor)


def test_readme_lmjax_commands_parse():
    """Each `lmjax ...` command the README shows is one the CLI's parser accepts (a renamed
    subcommand or flag fails here); running them is the job of the CLI and training tests."""
    text = README.read_text()
    commands = [argv for argv in _shell_blocks(text) if argv[0] == "lmjax"]
    # Inline ones too, except synopses (`lmjax inspect PRESET [key=value ...]`).
    inline = re.findall(r"`(lmjax [a-z][^`]*)`", text)
    commands += [
        shlex.split(span)
        for span in inline
        if not re.search(r"\[|\.\.\.|\b[A-Z]{2,}\b", span) and len(span.split()) > 2
    ]
    assert len(commands) >= 25, commands
    for argv in commands:
        args = cli._parse(argv[1:])
        assert args.command == argv[1], argv


def test_readme_benchmark_commands_name_scripts_and_flags_that_exist():
    """Each `python benchmarks/NAME.py [--flag ...]` in the README is a script whose --help
    (run as the README runs it, in its own process) lists those flags."""
    text = README.read_text()
    commands = {}
    for match in re.finditer(r"python (benchmarks/\w+\.py)((?: --[\w-]+)*)", text):
        commands.setdefault(match.group(1), set()).update(match.group(2).split())
    assert "benchmarks/tokenizer.py" in commands and "benchmarks/generate.py" in commands
    for script, flags in sorted(commands.items()):
        proc = subprocess.run(
            [sys.executable, script, "--help"],
            cwd=README.parent,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (script, proc.stderr[-2000:])
        for flag in flags:
            assert flag in proc.stdout, (script, flag)
