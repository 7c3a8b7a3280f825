"""The README's Python tour runs as written."""

import pathlib
import re

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
