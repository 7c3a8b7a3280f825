"""Smoke test of benchmarks/train_step.py: `--quick` shapes, one round of one step, in-process."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_train_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_json_with_agreeing_witness(tmp_path):
    bench = load_script()
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
    assert set(data["tokens_per_s"]) == {"lmjax", "torch_eager"}  # --quick skips torch.compile
    assert data["ratios"]["lmjax/torch_eager"] > 0
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
