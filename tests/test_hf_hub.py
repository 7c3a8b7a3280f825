"""`lmjax import-hf ORG/NAME` from the Hugging Face cache (issue 34, item 5).

The cache is built here as the hub lays it out (huggingface_hub's `file_download`): under
`HF_HOME/hub` (or `HF_HUB_CACHE`), `models--ORG--NAME/blobs/<sha256>` holds each file's bytes,
`snapshots/<commit>/<file>` is a relative symlink to its blob, `refs/main` the commit. The files
are `_llama_run.hf_checkpoint(chat=True)`'s (a tiny Llama saved by transformers). Checked: an
offline import of the id (a fresh process with HF_HOME and HF_HUB_OFFLINE=1, as a user sets them)
gives the same run as importing the directory; huggingface_hub's own `scan_cache_dir` reads the
cache (so the layout is the hub's); a missing id, with and without --download under
HF_HUB_OFFLINE, is one error line saying what to do; a local directory named like an id wins.
Cost: ~15 s (one subprocess importing jax; three in-process imports of a 112k-parameter model).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from _llama_run import hf_checkpoint
from huggingface_hub import constants

from lmjax import cli
from lmjax.io import hf_hub

REPO, COMMIT = "lmjax-test/tiny-chat", "0123456789abcdef0123456789abcdef01234567"


def hub_cache(cache: Path, source: Path, repo: str = REPO, commit: str = COMMIT) -> Path:
    """The files of `source` in `cache` as the hub stores repo `repo` at `commit`."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, root / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    hf_checkpoint(root / "hf", chat=True)
    hub_cache(root / "home" / "hub", root / "hf")
    assert cli.main(["import-hf", str(root / "hf"), "--out", str(root / "direct")]) == 0
    return root


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_the_cache_is_laid_out_as_the_hub_reads_it(saved):
    info = huggingface_hub.scan_cache_dir(saved / "home" / "hub")
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model" and not info.warnings
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and revision.refs == {"main"}
    assert {f.file_name for f in revision.files} == {p.name for p in (saved / "hf").iterdir()}


def test_import_hf_of_a_model_id_reads_the_cache_offline(saved, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_HOME": str(saved / "home"), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "lmjax", "import-hf", REPO, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    snapshot = saved / "home" / "hub" / "models--lmjax-test--tiny-chat" / "snapshots" / COMMIT
    assert done.stdout.startswith(f"imported {REPO} ({snapshot}) -> {out}: llama")
    assert _files(out) == _files(saved / "direct")  # the same run as from the directory
    assert (out / "tokenizer" / "generation_config.json").is_file()


def _one_error_line(argv, capsys) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmjax import-hf: error: "), captured.err
    assert captured.out == ""
    return lines[0]


def test_a_missing_model_id_is_one_line_saying_what_to_do(saved, tmp_path, capsys, monkeypatch):
    # constants are read when huggingface_hub is imported; this process imported it already.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(saved / "home" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # whatever this shell set
    argv = ["import-hf", "lmjax-test/absent", "--out", str(tmp_path / "run")]
    line = _one_error_line(argv, capsys)
    assert f"a model in the Hugging Face cache ({saved / 'home' / 'hub'})" in line
    assert "pass --download" in line
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    line = _one_error_line([*argv, "--download"], capsys)
    assert "HF_HUB_OFFLINE=1 forbids downloads" in line and "unset HF_HUB_OFFLINE" in line
    assert not (tmp_path / "run").exists()


def test_offline_a_mistyped_id_suggests_the_cached_one_not_download(
    saved, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(saved / "home" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 sets it
    line = _one_error_line(["import-hf", "lmjax-test/tiny-chta", "--out", "run"], capsys)
    assert "HF_HUB_OFFLINE=1 forbids downloads" in line and "--download" not in line
    assert f"Fix: did you mean {REPO} (cached)? Else copy the model into the cache" in line
    # The suggestion, as typed, imports offline.
    assert cli.main(["import-hf", REPO, "--out", str(tmp_path / "run")]) == 0
    assert _files(tmp_path / "run") == _files(saved / "direct")


def test_generate_on_a_hugging_face_directory_says_to_import_it(
    saved, tmp_path, capsys, monkeypatch
):
    shutil.copytree(saved / "hf", tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["generate", "--run", "hf", "--prompt", "The", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("lmjax generate: error: run path = 'hf'") and captured.out == ""
    assert "not a Hugging Face checkpoint (config.json)" in line
    fix = "Fix: import it first: lmjax import-hf hf --out runs/hf, then pass runs/hf."
    assert line.endswith(fix)
    # The fix, followed word for word, imports the directory.
    assert cli.main(["import-hf", "hf", "--out", "runs/hf"]) == 0
    assert _files(tmp_path / "runs" / "hf") == _files(saved / "direct")


def test_a_cached_revision_other_than_main(saved, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(saved / "home" / "hub"))
    out = tmp_path / "run"
    assert cli.main(["import-hf", REPO, "--revision", COMMIT, "--out", str(out)]) == 0
    assert _files(out) == _files(saved / "direct")
    capsys.readouterr()
    # main is cached, v2 is not: the error names the revision
    line = _one_error_line(
        ["import-hf", REPO, "--revision", "v2", "--out", str(tmp_path / "b")], capsys
    )
    assert f"{REPO}@v2" in line


def test_a_local_directory_named_like_an_id_wins(saved, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(saved / "hf", tmp_path / "lmjax-test" / "local")
    assert cli.main(["import-hf", "lmjax-test/local", "--out", "run"]) == 0
    assert capsys.readouterr().out.startswith("imported lmjax-test/local -> run: llama")
    assert _files(tmp_path / "run") == _files(saved / "direct")


@pytest.mark.parametrize(
    ("source", "is_id"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("Qwen/Qwen2.5-0.5B", True),
        ("runs/llama", True),  # a path that does not exist is looked up (and the error says so)
        ("./runs/llama", False),
        ("/abs/path", False),
        ("a/b/c", False),
        ("../up", False),
        ("gpt2", False),
        ("org/name.", False),
    ],
)
def test_what_counts_as_a_model_id(source, is_id):
    assert hf_hub.is_repo_id(source) == is_id
