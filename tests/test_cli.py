"""Tests for the `lmjax` command line (SPEC section 10): --help, gradcheck, one-line errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmjax.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, module: str = "lmjax") -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_help_lists_gradcheck():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "gradcheck" in proc.stdout
    assert proc.stdout.lstrip().startswith("usage: lmjax")


def test_python_m_lmjax_cli_is_the_cli_with_its_exit_codes():
    """`python -m lmjax.cli` (the cli package's __main__) runs `main` and exits with its code."""
    proc = _run("inspect", "gpt2", "--batch-size", "0", module="lmjax.cli")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("lmjax inspect: error: --batch-size = 0; expected an int >= 1")
    assert proc.stdout == ""


def test_gradcheck_help():
    proc = _run("gradcheck", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--ops" in proc.stdout and "--seed" in proc.stdout


def test_inspect_help_and_a_real_run():
    proc = _run("inspect", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--batch-size" in proc.stdout and "gpt2-350m" in proc.stdout
    proc = _run("inspect", "llama", "dtype=bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert "21,664" in proc.stdout and "activations kept for grad (bfloat16)" in proc.stdout
    # Names per layer, leaves stacked, and how the layers run (model.scan_layers).
    assert "blocks.1.feed_forward.gate.weight" in proc.stdout
    assert "layers: 2, stored stacked (each blocks.* leaf [2, ...]), run as one lax.scan" in (
        proc.stdout
    )
    scanned = _run("inspect", "llama", "dtype=bfloat16", "remat=none")
    unrolled = _run("inspect", "llama", "dtype=bfloat16", "remat=none", "scan_layers=false")
    assert unrolled.returncode == 0, unrolled.stderr
    assert "21,664" in unrolled.stdout and "run unrolled" in unrolled.stdout
    # One remat policy: unrolled layers read slices of the stacked weights, which the estimate
    # does not count as copies (they would add the 2 layers' bf16 weights, N P 2 = 40 KiB);
    # what an unrolled layer rebuilds for itself (its causal mask, its positions) is kept per
    # layer where the scan keeps it once, a few KiB.
    kept = [
        float(re.search(r"activations kept for grad \(bfloat16\)\s+([\d.]+) KiB", out)[1])
        for out in (scanned.stdout, unrolled.stdout)
    ]
    weights_kib = 2 * (4 * 32 * 32 + 3 * 32 * 64) * 2 / 1024
    assert 0 <= kept[1] - kept[0] < weights_kib, kept


def test_gradcheck_relu_passes():
    proc = _run("gradcheck", "--ops", "relu*")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    rows = [line for line in lines if line.split() and line.split()[0] == "relu_rank3"]
    assert len(rows) == 1
    assert rows[0].split()[-1] == "yes"
    # Only relu cases were selected: no other op case row appears.
    assert not any(line.startswith(("gelu", "leaky_relu", "softmax")) for line in lines)
    assert any(line.startswith("1/1 op cases agree") for line in lines)


def test_gradcheck_bad_ops_one_line_error():
    proc = _run("gradcheck", "--ops", "nope")
    assert proc.returncode == 2
    assert proc.stdout == ""
    err_lines = proc.stderr.splitlines()
    assert len(err_lines) == 1, proc.stderr
    assert err_lines[0].startswith("lmjax gradcheck: error:")
    assert "'nope'" in err_lines[0] and "Fix:" in err_lines[0]


def test_main_bad_ops_in_process(capsys):
    assert main(["gradcheck", "--ops", "nope"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("lmjax gradcheck: error:")
    assert "relu_rank3" in lines[0]  # the message lists the valid op-case names


def test_no_subcommand_exits_nonzero(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code not in (0, None)
    assert "usage: lmjax" in capsys.readouterr().err


def test_unknown_subcommand_exits_nonzero(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code not in (0, None)
    capsys.readouterr()


def test_an_explicit_decay_inside_the_warmup_is_still_refused(tmp_path, capsys, monkeypatch):
    """The issue's smoke run with `schedule.decay_steps` given and contradicting the warmup (a
    run of at most its warmup trains on the ramp only when the decay is left null): exit 2, one
    line naming the value and the warmup, nothing written. Costs no compile (~0.1 s)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be\n" * 50)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["train", str(ROOT / "configs/tiny-shakespeare.yaml"), "train.steps=3"]
    args += [f"data.corpus={corpus}", f"run.dir={tmp_path / 'run'}", "schedule.decay_steps=3"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert "schedule.decay_steps = 3; expected null or > warmup_steps = 50" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]
