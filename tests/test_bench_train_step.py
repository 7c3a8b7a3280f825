"""Smoke test of benchmarks/train_step.py: `--quick` shapes, one round of one step, in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _background import Worker
from _benchmarks import load_benchmark

pytest.importorskip("torch")


def test_quick_run_writes_json_with_agreeing_witness(tmp_path):
    bench = load_benchmark("train_step")
    result = bench.main(
        [
            "--quick",
            "--steps",
            "1",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--results-dir",
            str(tmp_path),
        ]
    )
    data = json.loads(Path(result["path"]).read_text())
    assert Path(result["path"]).parent == tmp_path
    for key in (
        "machine",
        "config",
        "first_step_s",
        "witness",
        "per_round_s_per_step",
        "median_s_per_step",
        "tokens_per_s",
        "peak_flops",
        "mfu",
        "ratios",
    ):
        assert key in data, key
    # --quick skips torch.compile; lmjax runs scanned (its default) and unrolled (issue 44).
    assert set(data["tokens_per_s"]) == {"lmjax", "lmjax_unrolled", "torch_eager"}
    assert data["ratios"]["lmjax/torch_eager"] > 0
    assert data["ratios"]["lmjax_scanned/lmjax_unrolled"] > 0
    # Scanned and unrolled from the same weights: the loss after one update agrees to float32
    # round-off (the same tolerance as the torch witness below).
    assert data["witness"]["lmjax_unrolled"]["loss_step2_rel_diff_from_scanned"] < 1e-5
    assert data["peak_flops"]["used"] > 0
    assert data["config"]["n_params"] > 0
    # Identical weights and batch: step-1 loss (same weights) and step-2 loss (after one AdamW
    # update with clipping) agree to float32 round-off, and so do the updated parameters.
    witness = data["witness"]["torch_eager"]
    assert witness["loss_step1_rel_diff"] < 1e-5
    assert witness["loss_step2_rel_diff"] < 1e-5
    assert witness["grad_norm_rel_diff"] < 1e-5
    for name, diff in witness["params_after_step1"].items():
        assert diff["p99_abs_diff_over_lr"] < 1e-2, name


# ---- lmjax bench (lmjax.train.bench, shared with the --scaling mode) ----------------------------

TINY = [
    "model.vocab_size=32",
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "train.batch_size=4",
    "train.grad_accum=2",
    "train.seq_len=16",
]
CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-shakespeare.yaml")


def test_lmjax_bench_times_a_config_and_writes_json(tmp_path, capsys):
    from lmjax import cli
    from lmjax.train.metrics import flops_per_token

    out = tmp_path / "bench.json"
    args = ["bench", CONFIG, *TINY, "--steps", "2", "--peak-tflops", "0.5", "--output", str(out)]
    assert cli.main(args) == 0
    assert "tokens/s" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data["step_s"]) == 2 and data["compile_s"] > 0
    assert data["tokens_per_step"] == 4 * 16 and data["grad_accum"] == 2
    assert data["tokens_per_s"] == pytest.approx(64 / data["median_step_s"])
    # MFU recomputed from its definition with the config's model and the given peak.
    from lmjax.models import ModelConfig

    fpt = flops_per_token(ModelConfig.from_dict(data["model"]), 16)
    assert data["mfu"] == pytest.approx(fpt * data["tokens_per_s"] / 0.5e12)
    assert data["finite"] and data["model"]["d_model"] == 32


def test_lmjax_bench_errors_are_one_line(capsys):
    from lmjax import cli

    # The char tokenizer's vocabulary comes from the corpus: the bench reads no data.
    assert cli.main(["bench", CONFIG, "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.vocab_size" in err
    assert cli.main(["bench", CONFIG, *TINY, "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert cli.main(["bench", CONFIG, *TINY, "train.batch_size=3"]) == 2
    assert "grad_accum" in capsys.readouterr().err


def _gpu_check_dry_run(workdir: Path) -> tuple[list[str], dict]:
    import os
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "GPU_CHECK_DRY_RUN": "1",
        "GPU_CHECK_STEPS": "train profile gradcheck evalbench",
        "PYTHON": sys.executable,
        "RESULTS_DIR": str(workdir),
    }
    return ["timeout", "300", "bash", str(root / "scripts" / "gpu_check.sh")], env


GPU_CHECK = Worker("gpu-check", _gpu_check_dry_run)


def start_in_background(names: set[str]) -> None:
    """Called by tests/conftest.py at collection with this module's selected tests: if the dry
    run below is one, its subprocess (~12 s of CPU) runs beside the suite."""
    if "test_gpu_check_dry_run_of_the_train_step_benchmark" in names:
        GPU_CHECK.start()


@pytest.mark.slow
def test_gpu_check_dry_run_of_the_train_step_benchmark():
    """scripts/gpu_check.sh steps 3b, 3, 3e and 6 on CPU (GPU_CHECK_DRY_RUN=1): the gpt2-124m
    config, shrunk, through `lmjax bench` (flash interpreted, bf16) and through the per-attention
    timing and profile; the lm-eval benchmark's tiny model; `lmjax gradcheck` on a few ops.
    RESULTS_DIR holds five files at most (the device machine returns 8), the rest packed into
    details.tar.gz."""
    import tarfile

    proc = GPU_CHECK.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = {p.name for p in proc.workdir.iterdir() if not p.name.startswith(".")}
    assert names == {"summary.json", "summary.txt", "gpu_check.log", "gpu_profile.json",
                     "details.tar.gz"}, names  # fmt: skip
    summary = json.loads((proc.workdir / "summary.json").read_text())
    steps = {s["step"]: s["outcome"] for s in summary["steps"]}
    assert steps["train"] == steps["profile"] == steps["gradcheck"] == "ok" and summary["finished"]
    assert steps["evalbench"] == "ok"  # lm_eval and torch are test dependencies
    with tarfile.open(proc.workdir / "details.tar.gz") as tar:
        data = json.load(tar.extractfile("./train_step_gpu.json"))
        scored = json.load(tar.extractfile("./eval_harness.json"))
        assert {"./environment.json", "./train_step_gpu.json"} <= set(tar.getnames())
    assert scored["per_second"]["lmjax"] > 0 and scored["equal_results"], scored
    assert data["model"]["attention"] == "flash" and data["model"]["dtype"] == "bfloat16"
    assert data["finite"] and data["tokens_per_s"] > 0 and 0 < data["mfu"]
    assert "train: cpu" in proc.stdout
    profile = json.loads((proc.workdir / "gpu_profile.json").read_text())
    runs = {r["attention"]: r for r in profile["runs"]}
    assert set(runs) == {"flash", "xla"} and all(r["tokens_per_s"] > 0 for r in runs.values())
    # The first attention that ran, once more right after with its blocks unrolled (issue 44).
    order = [(r["attention"], r["scan_layers"]) for r in profile["runs"]]
    assert order == [("flash", True), ("flash", False), ("xla", True)], order
    assert all(r["tokens_per_s"] > 0 and r["compile_s"] > 0 for r in profile["runs"])
    table = profile["profile"]
    assert table["attention"] == "flash" and table["kernels"] and table["busy_ms"] > 0
    shares = [k["share"] for k in table["kernels"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-6
    assert "op cases agree" in proc.stdout


@pytest.mark.slow
def test_scaling_mode_writes_rows_per_preset_and_length(tmp_path):
    bench = load_benchmark("train_step")
    args = ["--scaling", "--quick", "--steps", "1", "--threads", "1"]
    result = bench.main([*args, "--results-dir", str(tmp_path)])
    data = json.loads(Path(result["path"]).read_text())
    assert Path(result["path"]).name == "train_step_scaling_quick.json"
    rows = {(r["preset"], r["seq_len"]): r for r in data["rows"]}
    assert set(rows) == {("gpt", 16), ("llama", 16)}
    for r in rows.values():
        assert r["batch_size"] * r["seq_len"] == r["tokens_per_step"] == 64
        assert r["tokens_per_s"] == pytest.approx(64 / r["median_step_s"])
        assert r["mfu"] == pytest.approx(
            r["flops_per_token"] * r["tokens_per_s"] / data["peak_flops"]["used"]
        )
    # SwiGLU's third matrix: the llama row has more parameters at the same sizes.
    assert rows[("llama", 16)]["n_params"] != rows[("gpt", 16)]["n_params"]


def test_lmjax_bench_help(capsys):
    from lmjax import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--steps" in out and "--peak-tflops" in out and "MFU" in out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "bench" in capsys.readouterr().out
