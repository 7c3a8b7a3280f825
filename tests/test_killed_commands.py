"""Killed at a chosen moment, `prepare`, `import-hf`, `export-hf` and `finetune` leave each
output complete or absent, never half written, and the same command run again succeeds and
writes what a run that was never killed writes (issue 45, item 1).

The command is SIGKILLed as it starts a chosen call, so that call never happens: its first
fsync (strace: the output is being written under a hidden temporary), or the rename that puts
the output in place (os.rename and os.replace wrapped: everything is written, nothing
published). For `finetune`, the renames that
put its adapters and its merged model in place; the rerun is `--resume`. The inputs are the
committed tiny run of tests/fixtures/per_layer_run (its README).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmjax.files import replace_dir
from lmjax.train.rundir import STAGED_MERGED, RunDir

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "per_layer_run"
FINETUNE = """
finetune: {base: weights, qlora: false}
lora: {r: 2, alpha: 4, targets: ["*.attention.query"]}
data: {corpus: corpus.txt, tokenizer: char}
optimizer: {name: adamw, lr: 0.01}
schedule: {warmup_steps: 1, decay_steps: 2}
train: {steps: 2, batch_size: 2, seq_len: 16, eval_every: 2, eval_batches: 1}
checkpoint: {every: 2, keep: 1}
logging: {every: 1, progress: false, plot: false, sample_tokens: 0, sample_prompt: S}
"""

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """(root, env): copies of the fixture's corpus, HF directory and weights run, a fine-tune
    config, and the environment of every command (its own cache)."""
    root = tmp_path_factory.mktemp("killed")
    shutil.copy(FIXTURE / "corpus.txt", root / "corpus.txt")
    for name in ("hf", "weights"):
        shutil.copytree(FIXTURE / name, root / name)
    (root / "ft.yaml").write_text(FINETUNE)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(root / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return root, env


# `python -c KILLED_ONTO TARGET ARGS...`: lmjax ARGS, SIGKILLed as it renames something onto
# TARGET (strace's -P cannot name a path that does not exist yet).
KILLED_ONTO = """
import os, runpy, signal, sys
target = os.path.abspath(sys.argv.pop(1))
def killed_before(call):
    def wrapped(src, dst, *args, **kwargs):
        if os.path.abspath(dst) == target:
            os.kill(os.getpid(), signal.SIGKILL)
        return call(src, dst, *args, **kwargs)
    return wrapped
os.rename, os.replace = killed_before(os.rename), killed_before(os.replace)
sys.argv[0] = "lmjax"
runpy.run_module("lmjax", run_name="__main__", alter_sys=True)
"""


def lmjax(space, *args, strace: tuple = (), onto: Path | None = None):
    """`lmjax ARGS` in the workspace: under `strace ... STRACE` when given, or SIGKILLed as it
    renames something onto `onto`."""
    root, env = space
    prefix = ("strace", "-f", "-qq", "-o", "/dev/null", *strace) if strace else ()
    lmjax = ("-m", "lmjax") if onto is None else ("-c", KILLED_ONTO, onto)
    cmd = [*prefix, sys.executable, *lmjax, *args]
    return subprocess.run(
        list(map(str, cmd)), cwd=root, env=env, capture_output=True, text=True, timeout=600
    )


def first(call: str) -> tuple:
    """strace options that SIGKILL the process as it starts its first `call`."""
    return ("-e", f"trace={call}", "-e", f"inject={call}:signal=KILL:when=1")


def tree(path: Path) -> dict[str, object]:
    """Every file under `path` by relative name, with its bytes (a safetensors file's header
    parsed: its metadata's key order is not what is checked)."""
    return {str(p.relative_to(path)): _content(p) for p in path.rglob("*") if p.is_file()}


def _content(path: Path) -> object:
    data = path.read_bytes()
    if path.suffix != ".safetensors":
        return data
    size = int.from_bytes(data[:8], "little")  # u64 header length, the JSON header, the data
    header = json.loads(data[8 : 8 + size])
    meta = header.pop("__metadata__", {})
    return (
        header,
        {k: json.loads(v) if v[:1] in "{[" else v for k, v in meta.items()},
        data[8 + size :],
    )


def temporaries(out: Path) -> list[str]:
    """The hidden temporaries of `out` beside it (`.NAME.<16 hex>.tmp`)."""
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


COMMANDS = {
    "prepare": ("prepare", "--corpus", "corpus.txt", "--quiet", "--out"),
    "import-hf": ("import-hf", "hf", "--out"),
    "export-hf": ("export-hf", "weights", "--out"),
}


def _killed_then_rerun(space, command, out: Path, **kill) -> dict[str, bytes]:
    """Run `command OUT` killed as `kill` says (`lmjax`): nothing at OUT; run it again: it
    succeeds; the files it wrote."""
    killed = lmjax(space, *command, out, **kill)
    assert killed.returncode in (-9, 137), killed.stderr[-2000:]
    assert not out.exists(), sorted(tree(out)) if out.is_dir() else out
    again = lmjax(space, *command, out)
    assert again.returncode == 0, again.stderr[-2000:]
    return tree(out)


@pytest.mark.parametrize(
    "name",
    [
        "export-hf",
        "prepare",
        pytest.param("import-hf", marks=pytest.mark.slow),  # about 15 s
    ],
)
def test_a_command_killed_writing_or_publishing_its_output_leaves_none_and_reruns(space, name):
    """Killed at its first fsync (mid-write: a hidden temporary is all there is) and at the
    rename that publishes the output: no output either time, and both reruns write the same
    files, byte for byte."""
    command = COMMANDS[name]
    out = space[0] / f"{name}-a"
    written = _killed_then_rerun(space, command, out, strace=first("fsync"))
    assert written and temporaries(out), "the kill came before the output was being written"
    published = space[0] / f"{name}-b"
    again = _killed_then_rerun(space, command, published, onto=published)
    assert again == written


@pytest.mark.slow  # about 60 s: four fine-tunes of two steps
def test_a_finetune_killed_publishing_its_adapters_or_merged_model_resumes_to_the_same(space):
    """Killed as it renames its adapters, then its merged model, into place: the run holds
    no half-written file (the merged model absent, or the old one), and `--resume` writes the
    files an uninterrupted fine-tune writes."""
    root = space[0]
    straight = root / "ft-straight"
    assert lmjax(space, "finetune", "ft.yaml", f"run.dir={straight}").returncode == 0
    want = {k: v for k, v in tree(straight).items() if _final(k)}
    for target in ("adapters.safetensors", "merged"):
        run = root / f"ft-{target}"
        killed = lmjax(space, "finetune", "ft.yaml", f"run.dir={run}", onto=run / target)
        assert killed.returncode in (-9, 137), killed.stderr[-2000:]
        assert not (run / target).exists() and not (run / "merged").exists()
        resumed = lmjax(space, "finetune", "ft.yaml", f"run.dir={run}", "--resume")
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert {k: v for k, v in tree(run).items() if _final(k)} == want
        assert not [p.name for p in run.iterdir() if p.name.startswith(".")]


def _final(name: str) -> bool:
    """The files of a finished fine-tune that do not record when or how it ran."""
    return name == "adapters.safetensors" or name.startswith("merged/")


class _Killed(BaseException):
    """What a SIGKILL does to `replace_dir`: nothing after the call it stops runs."""


@pytest.mark.parametrize("at", [0, 1])
def test_replacing_merged_killed_at_either_rename_leaves_the_old_or_none(tmp_path, monkeypatch, at):
    """A fine-tune resumed after it finished replaces RUN/merged/: killed at the rename of the
    old one away (0) the old one stays whole; at the rename of the new one in (1) there is
    none. Either way the run's next start removes both temporaries."""
    run = RunDir(tmp_path / "run")
    (run.merged_dir / "tokenizer").mkdir(parents=True)
    (run.merged_dir / "weights.bin").write_bytes(b"old")
    staged = run.path / STAGED_MERGED
    staged.mkdir()
    (staged / "weights.bin").write_bytes(b"new")
    calls, rename = [], os.rename

    def killed_at(src, dst):
        calls.append(dst)
        if len(calls) > at:
            raise _Killed
        rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_at)
    with pytest.raises(_Killed):
        replace_dir(staged, run.merged_dir)
    monkeypatch.setattr(os, "rename", rename)
    if at == 0:
        assert tree(run.merged_dir) == {"weights.bin": b"old"}
    else:
        assert not run.merged_dir.exists()
    removed = run.remove_stale()
    assert STAGED_MERGED in removed and len(removed) == 1 + at, removed
    assert sorted(p.name for p in run.path.iterdir()) == (["merged"] if at == 0 else [])
