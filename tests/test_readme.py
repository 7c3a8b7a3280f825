"""The README and the pages under docs/ run as written: Python blocks, section links, lmjax and
benchmark commands."""

import json
import math
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from lmjax import cli
from lmjax.data import corpus

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# The README and the detail pages it points to, checked the same way.
PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]


def _text() -> str:
    """Every page's text, one after another (commands and figures may stand on any page)."""
    return "\n".join(page.read_text() for page in PAGES)


def test_readme_python_blocks_run(capsys):
    blocks = [
        (page, block)
        for page in PAGES
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    ]
    assert re.search(r"```python\n", README.read_text()), "the README has a Python tour"
    for page, block in blocks:
        exec(compile(block, str(page), "exec"), {})
    printed = capsys.readouterr().out
    assert "max |custom VJP - jax.grad|" in printed
    assert "(2, 4, 2, 8) (2, 2, 4, 4)" in printed
    assert "blocks.0.attention.query.bias" in printed
    assert "(2, 64, 65) 24800" in printed
    assert "steps 3 loss" in printed
    assert "[True, True]" in printed  # the generate tour
    assert "lora steps 3 loss falls True" in printed  # docs/fine-tuning.md's LoRA train state


def test_readme_names_the_two_commands_that_the_makefile_defines():
    text = _text()
    makefile = (README.parent / "Makefile").read_text()
    for target in ("demo", "test", "test-portable"):
        assert f"make {target}" in text
        assert re.search(rf"^{target}:", makefile, re.M)


def test_test_portable_hands_its_isa_to_the_tests_subprocesses(tmp_path):
    """`make test-portable ISA=...` adds --xla_cpu_max_isa to XLA_FLAGS, and a test that starts
    a subprocess with simulated devices keeps it beside its device count.

    The dry run's stamp is a fresh file outside the checkout: `make -n` still runs the recipes
    that remake a makefile, so a stamp named `Makefile` (older than pyproject.toml) would install
    the test extra for real; a stamp newer than pyproject.toml leaves nothing to install."""
    from _xla_flags import host_devices

    stamp = tmp_path / "installed-stamp"
    stamp.touch()
    dry = subprocess.run(
        ["make", "-n", "test-portable", "ISA=SSE4_2", f"STAMP={stamp}"],
        cwd=README.parent, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert (
        '--xla_cpu_max_isa=SSE4_2" ' in dry.stdout and "tests/test_parallel_mesh.py" in dry.stdout
    )
    flags = host_devices(8, "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=2")
    assert flags.split() == ["--xla_cpu_max_isa=AVX2", "--xla_force_host_platform_device_count=8"]
    assert host_devices(4, "") == "--xla_force_host_platform_device_count=4"


def _shell_blocks(text: str) -> list[str]:
    """Command lines of the ```bash blocks and of the `$ ` lines of plain blocks, with
    backslash continuations joined."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += [m.group(1) for m in re.finditer(r"^\$ (.*)$", text, re.M)]
    return [line for line in (shlex.split(raw, comments=True) for raw in lines) if line]


def _anchors(path: pathlib.Path) -> set[str]:
    """The `#anchor`s of a markdown file's headings, as GitHub spells them (lower case, spaces to
    '-', punctuation other than '-' dropped)."""
    headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_links_to_its_own_sections_resolve():
    """On every page, each `(#anchor)` link names one of its headings, and each relative link to
    a markdown file (`docs/training.md#training`, `../README.md#...`) names a file that exists and,
    with an anchor, a heading of that file."""
    linked = 0
    for page in PAGES:
        text = page.read_text()
        links = set(re.findall(r"\]\(#([^)]+)\)", text))
        assert links <= _anchors(page), (page.name, sorted(links - _anchors(page)))
        for path, anchor in re.findall(r"\]\(([\w./-]+\.md)#?([^)]*)\)", text):
            target = (page.parent / path).resolve()
            assert target.is_file(), (page.name, path)
            assert not anchor or anchor in _anchors(target), (page.name, path, anchor)
            linked += 1
        linked += len(links)
    assert linked >= 30, "the pages link to each other's sections"
    docs = {page for page in PAGES if page.parent.name == "docs"}
    readme_targets = {
        (README.parent / path).resolve()
        for path in re.findall(r"\]\((docs/[\w.-]+\.md)", README.read_text())
    }
    assert docs <= readme_targets, sorted(p.name for p in docs - readme_targets)


def test_readme_lmjax_commands_parse():
    """Each `lmjax ...` command the README shows is one the CLI's parser accepts (a renamed
    subcommand or flag fails here); running them is the job of the CLI and training tests."""
    text = _text()
    commands = [argv for argv in _shell_blocks(text) if argv[0] == "lmjax"]
    # Inline ones too, except synopses (`lmjax inspect PRESET [key=value ...]`) and quoted
    # messages (`lmjax chat: the context ... is full`).
    inline = re.findall(r"`(lmjax [a-z][^`]*)`", text)
    commands += [
        shlex.split(span)
        for span in inline
        if not re.search(r"\[|\.\.\.|\b[A-Z]{2,}\b|^lmjax [a-z-]+:", span) and len(span.split()) > 2
    ]
    assert len(commands) >= 25, commands
    for argv in commands:
        args = cli._parse(argv[1:])
        assert args.command == argv[1], argv


# Each script's --help, as `python benchmarks/NAME.py --help` runs it (`__main__`, its own
# directory first on sys.path, not the checkout; lmjax, pallas_kernels and the benchmarks'
# modules imported afresh; the environment restored), all in one process: jax, torch and the
# tokenizer libraries are imported once instead of once per script (15 s of CPU, now ~5).
HELP = r"""
import contextlib, io, json, os, runpy, sys, traceback

scripts, env, path = sys.argv[1:], dict(os.environ), sys.path[1:]  # not -c's cwd entry
ours = ("lmjax", "pallas_kernels", "benchmarks")
bench_dir = os.path.realpath("benchmarks") + os.sep
report = {}
for script in scripts:
    for name, module in list(sys.modules.items()):
        where = os.path.realpath(getattr(module, "__file__", None) or "/")
        if name.split(".")[0] in ours or where.startswith(bench_dir):
            del sys.modules[name]
    sys.path[:] = [os.path.dirname(os.path.realpath(script)), *path]
    sys.argv, out, code, err = [script, "--help"], io.StringIO(), 0, ""
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        code, err = 1, traceback.format_exc()
    os.environ.clear()
    os.environ.update(env)
    report[script] = {"code": code, "stdout": out.getvalue(), "error": err}
print(json.dumps(report))
"""


def test_readme_benchmark_commands_name_scripts_and_flags_that_exist():
    """Each `python benchmarks/NAME.py [--flag ...]` in the README is a script whose --help
    (each run as `python benchmarks/NAME.py --help` would run it, all of them in one process
    outside the suite's: HELP) lists those flags."""
    text = _text()
    commands = {}
    for match in re.finditer(r"python (benchmarks/\w+\.py)((?: --[\w-]+)*)", text):
        commands.setdefault(match.group(1), set()).update(match.group(2).split())
    assert "benchmarks/tokenizer.py" in commands and "benchmarks/generate.py" in commands
    proc = subprocess.run(
        [sys.executable, "-c", HELP, *sorted(commands)],
        cwd=README.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    helps = json.loads(proc.stdout.strip().splitlines()[-1])
    for script, flags in sorted(commands.items()):
        done = helps[script]
        assert done["code"] == 0, (script, done["error"][-2000:] or proc.stderr[-2000:])
        for flag in flags:
            assert flag in done["stdout"], (script, flag)


# ---- the README's commands, executed as shown ----------------------------------------------
#
# What no test here executes, and why (the README's other commands): `make demo` runs
# `lmjax prepare` and `lmjax train configs/tiny-shakespeare.yaml`; `make test`, `make test-fast`,
# `make test-portable` (the sensitive files again, under another --xla_cpu_max_isa),
# `make lint`, `make bench` and `make strip-notebooks` are the suite itself or run over the whole
# tree (tests/test_notebooks.py runs strip-notebooks' script on an executed copy);
# `source .venv/bin/activate` changes only the shell; `python -m ipykernel install --user` writes
# into the user's Jupyter; `scripts/gpu_check.sh` needs a GPU; `scripts/tpu/tpu.sh` and
# `scripts/gpu/train.sh` need gcloud or GPU hosts (their dry runs are tests/test_scripts.py);
# `lmjax import-hf ~/models/gpt2` and the imported-GPT-2 lines need GPT-2's real weights
# (tests/test_hf_gpt2.py runs them on a small one); `python benchmarks/train_step.py` and
# `qlora.py` are timed runs
# (tests/test_bench_train_step.py and tests/test_qlora.py run them in-process on tiny settings).

ROOT = README.parent
MIB = 2**20
# GPT-2 small, from its published architecture (not from lmjax): 12 layers, d 768, d_ff 3072,
# vocabulary 50257, context 1024, biases, LayerNorm, a head tied to the token embedding.
GPT2 = {"layers": 12, "d": 768, "f": 3072, "vocab": 50257, "context": 1024}


def _gpt2_counts() -> dict[str, int]:
    L, d, f = GPT2["layers"], GPT2["d"], GPT2["f"]
    per_layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d  # attention, MLP, 2 norms
    return {
        "total": L * per_layer + (GPT2["vocab"] + GPT2["context"]) * d + 2 * d,
        "projection_sizes": [d * d] * 4 * L + [d * f, f * d] * L,
        "vectors": L * (4 * d + f + d + 4 * d) + 2 * d,  # biases and norm scales/biases
    }


def _nf4_bytes(n: int) -> int:
    """The storage of n NF4 weights (docs/kernels.md): codes, block absmax codes, group scales,
    offset."""
    return n // 2 + math.ceil(n / 64) + 4 * math.ceil(n / 16384) + 4


def _inspect_commands(text: str) -> list[list[str]]:
    lines = [argv for argv in _shell_blocks(text) if argv[:2] == ["lmjax", "inspect"]]
    lines += [shlex.split(s) for s in re.findall(r"`(lmjax inspect [^`\[A-Z]*)`", text)]
    unique = []
    for argv in lines:
        if len(argv) > 2 and argv not in unique:
            unique.append(argv)
    return unique


def _figure(pattern: str, out: str) -> int:
    match = re.search(pattern, out, re.M)
    assert match, (pattern, out[-3000:])
    return int(match.group(1).replace(",", ""))


def test_readme_inspect_commands_run_as_shown(capsys, tmp_path, monkeypatch):
    """Every `lmjax inspect ...` line of the README (blocks, `$` lines and inline) runs as shown,
    in-process, and prints figures that agree with counts made here from GPT-2's architecture,
    SPEC's NF4 formula and the README's own text.

    `configs/tiny-shakespeare.yaml` takes its vocabulary from the corpus: with the Shakespeare
    text already in the user's cache it runs on a copy of it (in a temporary cache); otherwise
    with `data.corpus=` set to Python's documentation text (a test never downloads)."""
    text = _text()
    commands = _inspect_commands(text)
    shown = {shlex.join(argv) for argv in commands}
    for expected in (
        "lmjax inspect gpt2-124m",
        "lmjax inspect configs/tiny-shakespeare.yaml",
        "lmjax inspect gpt2 --qlora --lora r=8,targets=all-linear",
        "lmjax inspect configs/tpu-gpt2-124m.yaml --mesh data=1,fsdp=8",
    ):
        assert expected in shown, sorted(shown)
    cached = corpus.cache_dir() / "shakespeare.txt"  # read before XDG_CACHE_HOME moves
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    corpus_override = []
    if cached.is_file():
        (tmp_path / "cache" / "lmjax").mkdir(parents=True)
        shutil.copyfile(cached, corpus.cache_dir() / "shakespeare.txt")
        corpus_text = cached.read_text(encoding="utf-8")
    else:
        import pydoc_data.topics

        corpus_text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
        (tmp_path / "docs.txt").write_text(corpus_text, encoding="utf-8")
        corpus_override = [f"data.corpus={tmp_path / 'docs.txt'}"]

    monkeypatch.chdir(ROOT)  # the config paths are relative to the checkout, as in the README
    gpt2 = _gpt2_counts()
    mib = lambda n: f"{n / MIB:.1f} MiB"  # noqa: E731
    for argv in commands:
        line = shlex.join(argv)
        extra = corpus_override if "tiny-shakespeare.yaml" in line else []
        assert cli.main(argv[1:] + extra) == 0, (line, capsys.readouterr().err)
        out = capsys.readouterr().out
        total = _figure(r"^total\s+([\d,]+)$", out)
        if argv[2] in ("gpt2", "gpt2-124m") or "gpt2-124m.yaml" in argv[2]:
            assert total == gpt2["total"] == 124_439_808, line  # Hugging Face's count
            assert mib(4 * total) == "474.7 MiB"
            assert re.search(rf"^\s+parameters \(float32\)\s+{mib(4 * total)}$", out, re.M)
        if line == "lmjax inspect gpt2-124m":
            # The README shows this command's output: each line it shows is printed.
            block = re.search(r"^\$ lmjax inspect gpt2-124m\n(.*?)```", text, re.M | re.S)
            for shown_line in block.group(1).splitlines():
                if shown_line.strip() and shown_line.strip() != "...":
                    assert shown_line.split() in [o.split() for o in out.splitlines()], shown_line
        if "tiny-shakespeare.yaml" in line:
            # A Llama block (4 bias-free projections d x d, SwiGLU's 3 of d x f, 2 RMSNorm scales)
            # x 4, a final norm, and untied embedding and head over one id per character.
            vocab = _figure(r"vocab_size=(\d+)", out)
            assert vocab == len(set(corpus_text))
            d, f = 128, 384
            assert total == 4 * (4 * d * d + 3 * d * f + 2 * d) + d + 2 * vocab * d, (vocab, total)
        if "--mesh" in argv:
            mesh = dict(kv.split("=") for kv in argv[argv.index("--mesh") + 1].split(","))
            devices = math.prod(int(v) for v in mesh.values())
            per_device = _figure(r"^\s+parameters \(float32\).*\(([\d,]+) B\)$", out)
            # Sharded: at least an even share of the float32 parameters, at most the fsdp share
            # of the matrices plus every vector (biases, norms) whole.
            vectors = gpt2["vectors"]
            most = 4 * (total - vectors) / int(mesh["fsdp"]) + 4 * vectors
            assert 4 * total / devices <= per_device <= most, (line, per_device)
            if "--batch-size" in argv:
                rows = int(argv[argv.index("--batch-size") + 1]) // int(mesh["fsdp"])
                assert f"activations ({rows} of {argv[argv.index('--batch-size') + 1]}" in out
        if "--qlora" in argv or "--lora" in argv:
            lora_text = argv[argv.index("--lora") + 1] if "--lora" in argv else ""
            r = 8  # the README's r, and --lora's default
            d, f, L = GPT2["d"], GPT2["f"], GPT2["layers"]
            if "all-linear" in lora_text:
                adapters = L * r * (4 * (d + d) + (d + f) + (f + d))
            else:  # the default targets: query and value
                adapters = L * r * 2 * (d + d)
            assert _figure(r"adapters, trainable \(([\d,]+) params\)", out) == adapters, line
            if "--qlora" in argv:  # NF4 projections, the rest float32
                nf4 = sum(map(_nf4_bytes, gpt2["projection_sizes"]))
                frozen = nf4 + 4 * (total - sum(gpt2["projection_sizes"]))
            else:  # a float32 base
                frozen = 4 * total
            assert re.search(rf"frozen base weights .*\s{re.escape(mib(frozen))}$", out, re.M)
            grand = frozen + 4 * adapters * 4  # adapters, their gradients, AdamW's 2 moments
            assert re.search(
                rf"total \(without activations\)\s+{re.escape(mib(grand))}$", out, re.M
            )
            if "all-linear" in lora_text:  # the figures the README quotes for this command
                assert mib(frozen) == "192.5 MiB" and mib(grand) == "212.7 MiB"
                assert "QLoRA 212.7 MiB" in text and "| 192.5 MiB | 212.7 MiB |" in text


FINETUNE_LORA = "lmjax finetune configs/finetune-lora.yaml --lora r=8,alpha=16"
GENERATE_LORA = "lmjax generate --run runs/finetune-lora --prompt ROMEO:"


def test_readme_finetune_lines_run_on_a_tiny_base(capsys, tmp_path, monkeypatch):
    """The README's LoRA fine-tune line and the `generate` line after it, run with its config
    file and flags from a directory where `configs/` is the checkout's and `runs/` is new.

    The line before them, `lmjax train configs/tiny-shakespeare.yaml` (what `make demo` runs),
    is replaced by a weights-only base at the path the fine-tune configs name, built from that
    config with a tiny model (1 layer, d_model 32, context 16) on Python's documentation text
    (plus the prompt's characters; a test never downloads Shakespeare). The fine-tune line gets
    overrides appended for the same text and 2 steps of 2 x 16 characters without progress bar,
    plot or samples; the generate line runs exactly as shown. The QLoRA line
    (`configs/finetune-qlora.yaml`, the same file with `qlora: true`) is not run here: its
    compiles alone cost ~12 s of CPU; tests/test_finetune.py runs `finetune --qlora`."""
    import pydoc_data.topics

    import jax

    from lmjax import lora, models
    from lmjax.config import load_run_config
    from lmjax.train import loop
    from lmjax.train.runs import write_weights_run

    shown = [shlex.join(argv) for argv in _shell_blocks(_text())]
    assert FINETUNE_LORA in shown and GENERATE_LORA in shown
    assert "lmjax train configs/tiny-shakespeare.yaml" in shown
    topics = pydoc_data.topics.topics
    (tmp_path / "text.txt").write_text("ROMEO:\n" + "".join(topics[k] for k in sorted(topics)))
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tiny_model = [
        "model.n_layers=1",
        "model.d_model=32",
        "model.d_ff=64",
        "model.context_length=16",
    ]
    overrides = ["data.corpus=text.txt", "train.seq_len=16", *tiny_model]
    cfg = load_run_config("configs/tiny-shakespeare.yaml", overrides)
    prepared = loop.prepare_data(cfg, progress=False)
    model = loop.resolve(cfg, prepared).model_config()
    base = models.init(jax.random.PRNGKey(0), model)
    write_weights_run(cfg.run.dir, base, model, prepared.tokenizer, "char")
    assert cfg.run.dir == "runs/tiny-shakespeare"  # where finetune-lora.yaml looks for its base

    tiny_run = [
        "data.corpus=text.txt",
        "train.steps=2",
        "schedule.warmup_steps=0",
        "train.batch_size=2",
        "train.seq_len=16",
        "train.eval_every=2",
        "train.eval_batches=1",
        "checkpoint.every=2",
        "logging.progress=false",
        "logging.plot=false",
        "logging.sample_tokens=0",
        "logging.peak_flops=1e12",  # no matmul timing
    ]
    argv = shlex.split(FINETUNE_LORA)[1:] + tiny_run
    assert cli.main(argv) == 0, capsys.readouterr().err[-2000:]
    assert cli.main(shlex.split(GENERATE_LORA)[1:]) == 0, capsys.readouterr().err[-2000:]
    out = capsys.readouterr().out
    # --lora r=8,alpha=16 over the file's lora section: rank 8 adapters on the file's targets.
    adapters, lcfg = lora.load_adapters("runs/finetune-lora/adapters.safetensors")
    assert (lcfg.r, lcfg.alpha, lcfg.targets) == (8, 16, ("*.attention.query", "*.attention.value"))
    assert set(lora.adapter_shapes(adapters)) == {
        "blocks.0.attention.query",
        "blocks.0.attention.value",
    }
    assert {shape[2] for shape in lora.adapter_shapes(adapters).values()} == {8}
    spec = (tmp_path / "runs/finetune-lora/finetune.yaml").read_text()
    assert re.search(r"^\s+base: runs/tiny-shakespeare$", spec, re.M), spec
    assert re.search(r"^\s+qlora: false$", spec, re.M), spec
    # generate read the merged run and streamed the prompt and the 10 characters that fit in
    # the context of 16.
    sample = out.rstrip("\n").rsplit("ROMEO:", 1)[1]
    assert len(sample) >= 10, out[-500:]


def run_benchmark(script: str, *argv: str) -> None:
    """`python benchmarks/SCRIPT ARGV` from the repo root in its own process; it must succeed."""
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_readme_attention_benchmark_runs_with_tiny_settings(tmp_path):
    """`python benchmarks/attention.py` (the README's attention-memory figures) runs in its own
    process with two short sequences into a temporary file (benchmarks/results untouched), and
    what it reports each implementation keeps for the backward pass is what the algorithms
    need, counted here: flash keeps q, k, v, the output and one logsumexp per row (no T x T
    array); materialized attention keeps at least q, k, v and the causal probabilities it
    computes: all T x T of them at T = 64 (one query block), and at T = 128 the two 64-row
    blocks against their key prefixes, 64 x 64 + 64 x 128 (the all-masked block is skipped).
    `tokenizer.py` and `generate.py` run tiny in the next tests."""
    out = tmp_path / "attention.json"
    run_benchmark("attention.py", "--seq-lens", "64", "128", "--out", str(out))
    assert out.with_suffix(".png").is_file()
    result = json.loads(out.read_text())
    B, H, D, f32 = 1, 4, 64, 4  # the script's defaults (batch, heads, head dim), float32
    assert (result["config"]["batch"], result["config"]["heads"]) == (B, H)
    assert result["config"]["head_dim"] == D
    rows = {(r["impl"], r["T"]): r["residual_bytes"] for r in result["rows"]}
    kept_probabilities = {64: 64 * 64, 128: 64 * 64 + 64 * 128}
    for T in (64, 128):
        qkvo = 4 * B * T * H * D * f32
        lse = B * H * T * f32
        assert qkvo + lse <= rows["flash", T] <= qkvo + lse + 64, (T, rows["flash", T])
        probabilities = B * H * kept_probabilities[T] * f32
        assert rows["materialized", T] >= 3 * B * T * H * D * f32 + probabilities, T
    # The skipped block shows: T = 128 keeps less than q, k, v plus a full T x T matrix.
    assert rows["materialized", 128] < 3 * B * 128 * H * D * f32 + B * H * 128 * 128 * f32


def _guarantee_rows(text: str) -> list[tuple[str, list[str]]]:
    """`(promise, ["tests/file.py::test_name", ...])` for each row of the Guarantees table."""
    section = re.search(r"^#+ Guarantees\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/guarantees.md has a 'Guarantees' table (issue 12)"
    rows = []
    for line in section.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[-1]) <= set("-: "):
            continue
        if cells == ["promise", "proved by"]:
            continue
        rows.append((cells[0], re.findall(r"`([^`]*)`", cells[-1])))
    return rows


def test_readme_guarantees_name_tests_that_exist():
    """Each promise names at least one `tests/file.py::test_name`, and that file defines that
    test function at its top level (a renamed or deleted test would leave a promise unproved)."""
    import ast

    rows = _guarantee_rows((ROOT / "docs" / "guarantees.md").read_text())
    assert len(rows) >= 10, len(rows)
    defined: dict[str, set[str]] = {}
    missing = []
    for promise, refs in rows:
        tests = [ref for ref in refs if "::" in ref]
        assert tests, f"the promise {promise[:60]!r} names no tests/file.py::test_name"
        for ref in tests:
            file, _, name = ref.partition("::")
            path = ROOT / file
            if file not in defined:
                tree = ast.parse(path.read_text()) if path.is_file() else ast.Module([], [])
                defined[file] = {
                    node.name
                    for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
                }
            if name not in defined[file]:
                missing.append(ref)
    assert not missing, missing


def test_readme_tokenizer_benchmark_runs_with_tiny_settings(tmp_path):
    """`python benchmarks/tokenizer.py` (the README's tokenizer figures) on 50 kB into a temporary
    file: the four GPT-2 encoders (lmjax's two engines, tiktoken, Hugging Face `tokenizers`)
    give the same ids, and both trainers reach the vocabulary asked for."""
    out = tmp_path / "tokenizer.json"
    argv = ["--mb", "0.05", "--train-mb", "0.05", "--vocab", "300", "--output", str(out)]
    run_benchmark("tokenizer.py", *argv)
    result = json.loads(out.read_text())
    engines = result["encode"]["engines"]
    assert len(engines) == 4 and all(e["ids_equal_to_first"] for e in engines.values()), engines
    assert result["encode"]["bytes"] >= 50_000 and result["encode"]["tokens"] > 0
    assert result["train"]["vocab_size"] == 300


def test_readme_generate_benchmark_runs_with_tiny_settings(tmp_path):
    """`python benchmarks/generate.py` (the README's decoding figures) with one GPT-2-sized
    layer, one batch and 4 new tokens into a temporary file: lmjax's greedy tokens equal
    `transformers`' on the same weights and prompts, one row per batch size asked for."""
    out = tmp_path / "generate.json"
    argv = ["--layers", "1", "--batches", "1", "--prompt-len", "4", "--new-tokens", "4"]
    run_benchmark("generate.py", *argv, "--repeats", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["model"]["n_layers"] == 1 and result["model"]["vocab_size"] == 50257
    (row,) = result["results"]
    assert (row["batch"], row["new_tokens"]) == (1, 4)
    assert row["tokens_identical"], row
    # lmjax's default splits the blocks per layer on this CPU; stacked, the same tokens.
    assert row["lmjax_blocks"] == "layers" and row["stacked_tokens_identical"], row
