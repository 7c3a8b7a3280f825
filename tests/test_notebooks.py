"""Every notebook in notebooks/ runs top to bottom (SPEC section 1, issue 10).

Each notebook is run the way the README says, by nbclient's `jupyter execute` (from the test
extra), on a copy in a temporary directory (the kernel's working directory, so nothing is
written into the repository). The kernel is an ipykernel running this interpreter: a kernelspec
in a temporary JUPYTER_PATH points at `sys.executable`, whatever kernels the user has installed.
`LMJAX_NOTEBOOK_SMALL=1` selects tiny settings (each notebook reads it in its first cell);
XDG_CACHE_HOME, TMPDIR, IPython's and Jupyter's runtime directories are temporary too (nothing
lands in the user's home). A failing cell fails the test. The committed notebooks must carry no
outputs (`make strip-notebooks` strips them); the executed copies must show what each notebook is
there to show.

The quickstart trains on the bundled Shakespeare corpus when it is already cached (a test never
downloads it); otherwise on Python's own documentation text (`pydoc_data.topics`), a small real
text that every Python install carries.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lmjax import testing
from lmjax.train import corpus

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "lmjax-test-venv"
CELL_TIMEOUT_S = 300  # per cell; the whole module takes far less (see the README's Notebooks)


def test_the_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    for expected in ("01_quickstart", "02_custom_vjp_vs_grad", "04_attention_kernels"):
        assert f"{expected}.ipynb" in names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_are_stripped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert nb.metadata.kernelspec.language == "python"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """(root, environment) for `jupyter execute`: our kernelspec first on JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("notebooks")
    spec_dir = root / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec = {"argv": argv, "display_name": "lmjax test (.venv)", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    cached = corpus.cache_dir() / "shakespeare.txt"  # read before XDG_CACHE_HOME moves
    if cached.is_file():
        text_path = cached
    else:
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        text_path = root / "python-docs.txt"
        text_path.write_text("".join(topics[k] for k in sorted(topics)), encoding="utf-8")
    import matplotlib

    (root / "tmp").mkdir()
    env = {
        **os.environ,
        "LMJAX_NOTEBOOK_SMALL": "1",
        "LMJAX_NOTEBOOK_CORPUS": str(text_path),
        "JUPYTER_PATH": str(root / "jupyter"),
        "JUPYTER_RUNTIME_DIR": str(root / "runtime"),  # connection files
        "IPYTHONDIR": str(root / "ipython"),
        "XDG_CACHE_HOME": str(root / "cache"),  # prepared token files
        "TMPDIR": str(root / "tmp"),  # the quickstart's checkpoint directory
        # matplotlib would otherwise follow XDG_CACHE_HOME and rebuild its font cache.
        "MPLCONFIGDIR": matplotlib.get_cachedir(),
    }
    return root, env


def execute(path: Path, sandbox) -> nbformat.NotebookNode:
    """Run a copy of the notebook in its own directory, as the README says, and read it back."""
    root, env = sandbox
    workdir = root / path.stem
    workdir.mkdir()
    copy = workdir / path.name
    shutil.copyfile(path, copy)
    # `python -m jupyter execute` is `.venv/bin/jupyter execute` without guessing the script path.
    command = [sys.executable, "-m", "jupyter", "execute", str(copy), "--inplace"]
    command.append(f"--kernel_name={KERNEL}")
    command.append(f"--timeout={CELL_TIMEOUT_S}")
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    # A failing cell: jupyter execute exits non-zero with the cell and its traceback on stderr.
    assert done.returncode == 0, done.stderr[-6000:]
    assert f"kernel: {KERNEL}" in done.stderr  # our kernelspec, i.e. this interpreter
    assert [p.name for p in workdir.iterdir()] == [path.name], "the notebook wrote into its cwd"
    return nbformat.read(copy, as_version=4)


def text_of(nb) -> str:
    """Every stream and text/plain output of the executed notebook, in order."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif "data" in out and "text/plain" in out.data:
                parts.append(out.data["text/plain"])
    return "\n".join(parts)


def n_images(nb) -> int:
    return sum(
        "image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", [])
    )


def number(pattern: str, text: str) -> tuple[float, ...]:
    match = re.search(pattern, text)
    assert match, f"no output matches {pattern!r}"
    return tuple(float(g) for g in match.groups())


@pytest.mark.slow
def test_quickstart_trains_samples_and_reloads(sandbox):
    nb = execute(ROOT / "notebooks/01_quickstart.ipynb", sandbox)
    text = text_of(nb)
    first, last = number(r"train loss (\d+\.\d+) -> (\d+\.\d+)", text)
    # 60 AdamW steps of a character model: at least one nat below the first step's loss.
    assert last < first - 1.0, (first, last)
    before, after = number(r"before saving (\d+\.\d+), after reloading (\d+\.\d+)", text)
    assert before == after
    assert "identical after the round trip: True" in text
    assert "total" in text and "memory estimate" in text  # the inspect table
    assert n_images(nb) >= 1  # the loss plot


@pytest.mark.slow
def test_custom_vjp_notebook_agrees_with_grad_and_finite_differences(sandbox):
    nb = execute(ROOT / "notebooks/02_custom_vjp_vs_grad.ipynb", sandbox)
    text = text_of(nb)
    (n_cases,) = number(r"(\d+) op cases", text)
    assert n_cases >= 11  # every primitive family, even in the small setting
    # The notebook's own bounds are lmjax.testing's; check the printed worst cases against them.
    (vjp,) = number(r"custom VJP vs jax\.grad\(reference\): worst relative difference (\S+)", text)
    (fd,) = number(r"custom VJP vs finite differences: worst relative error (\S+)", text)
    (fd_ref,) = number(r"jax\.grad\(reference\) vs finite differences: worst .* error (\S+)", text)
    assert vjp <= testing.F32_RTOL and fd <= testing.FD_RTOL and fd_ref <= testing.FD_RTOL
    (model,) = number(r"whole model: worst relative gradient difference (\S+)", text)
    assert model <= testing.F32_RTOL
    # The V: the error at the best step is far below the errors at both ends of the sweep.
    best, large_h, small_h = number(
        r"best step .* error (\S+); at the largest h (\S+), at the smallest h (\S+)", text
    )
    assert best < 1e-3 * large_h and best < 1e-3 * small_h
    assert n_images(nb) >= 1


@pytest.mark.slow
def test_attention_kernels_notebook(sandbox):
    nb = execute(ROOT / "notebooks/04_attention_kernels.ipynb", sandbox)
    text = text_of(nb)
    out, grad = number(
        r"flash vs materialized: max \|out diff\| (\S+), max \|grad diff\| (\S+)", text
    )
    assert out <= 1e-5 and grad <= 1e-5  # float32, as tests/test_flash_attention.py
    mat, flash = number(r"residual bytes grow as T\^(\S+) \(materialized\) and T\^(\S+)", text)
    assert mat > 1.5 and flash < 1.2
    assert n_images(nb) >= 1
