"""Killed at chosen file-system calls of a save, and at random moments, `lmjax train --resume`
ends bit for bit at the uninterrupted run (issue 45; the full sweeps are
benchmarks/kill_points.py and benchmarks/random_kills.py, this runs a few of each).

The points come from the strace record of an uninterrupted run (which is then the reference):
the rename that commits step 3, the first removal inside the dropped step 1, and the append of
step 3's validation loss (the checkpoint is on disk, its evaluation is not: the resume must run
it again, or the logged losses lack it).
"""

from __future__ import annotations

import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest
from _benchmarks import load_benchmark

from lmjax.data import prepared
from lmjax.files import atomic_write_text, remove_stale, temporary_of
from lmjax.train.checkpoint import Checkpoints
from lmjax.train.rundir import RunDir

kill_points = load_benchmark("kill_points")
random_kills = load_benchmark("random_kills")
K = kill_points.K

needs_strace = pytest.mark.skipif(
    shutil.which(kill_points.STRACE) is None, reason="strace is not installed"
)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(root, env, the reference, the points listed) from one traced uninterrupted run."""
    root = tmp_path_factory.mktemp("kills")
    env = K.workspace(root)
    run = root / "recorded"
    calls = kill_points.record(root, env, run, root / "strace.txt")
    return root, env, K.Reference(run), kill_points.points(calls)


def _point(points, call, path, when=1):
    (point,) = [p for p in points if (p["call"], p["path"], p["when"]) == (call, path, when)]
    return point


@needs_strace
@pytest.mark.parametrize(
    "call, path",
    [
        ("rename", "RUN/checkpoints/3.orbax-checkpoint-tmp"),  # the commit of step 3
        pytest.param(  # step 1 half removed (a .dropped left: also the unit test below)
            "unlinkat", "RUN/checkpoints/1.dropped", marks=pytest.mark.slow
        ),
        ("openat", "RUN/metrics.jsonl"),  # step 3 saved, its val_loss not yet logged
    ],
)
def test_a_kill_at_a_listed_call_resumes_to_the_uninterrupted_run(recorded, call, path):
    root, env, ref, points = recorded
    in_save = [p for p in points if p["phase"] == "save 3"]
    point = _point(in_save, call, path)
    n = f"{call}-{path.rsplit('/', 1)[-1]}"
    out = kill_points.check_point(root, env, point, n, ref)
    assert out["killed"], out
    assert out["checks"] == {"resume": []}, out
    if call == "rename":  # killed before the commit: step 3 is not listed, 2 is
        assert "3" not in out["left"] and "2" in out["left"], out["left"]


@pytest.mark.slow  # about 90 s: two uninterrupted runs and about 15 starts
def test_ten_random_kills_end_at_the_uninterrupted_run(tmp_path):
    result = random_kills.campaign(tmp_path, kills=10, seed=1, max_per_run=5, output=None)
    assert result["kills"] == 10 and result["runs"] >= 2, result
    bad = ("failed_restores", "runs_differing", "temporaries_left")
    assert {k: result[k] for k in bad} == dict.fromkeys(bad, 0), result["failures"]


def test_a_run_killed_while_writing_its_config_is_a_start(tmp_path):
    """What a kill inside `atomic_write_text(config.yaml)` leaves (its temporary) does not make
    the directory a run: a fresh start and --resume take it, and the temporary is removed."""
    run = RunDir(tmp_path / "run")
    for name in ("checkpoints", "tensorboard"):
        (run.path / name).mkdir(parents=True)
    run.metrics_file.write_text("")
    tmp = run.path / ".config.yaml.0123456789abcdef.tmp"
    tmp.write_text("model: {preset: g")  # cut short
    assert temporary_of(tmp.name) == "config.yaml"
    assert run.never_started() and run.check_writable(resume=True) is False
    (run.path / ".notes.txt.0123456789abcdef.tmp").write_text("not ours to remove")
    assert not run.never_started()
    assert run.remove_stale() == [tmp.name] and not tmp.exists()
    atomic_write_text(run.config_file, "x: 1\n")
    assert remove_stale(run.path, ("config.yaml",)) == []  # the written file is no temporary


class _State(NamedTuple):
    step: jax.Array
    params: dict


def test_the_steps_beyond_keep_are_dropped_and_a_half_dropped_one_is_removed(tmp_path):
    """keep=2 over four saves lists and holds steps 3 and 4 only; what a kill inside a drop
    leaves (`1.dropped`, partly removed) is never listed and goes with `remove_temporary`."""
    ckpt = Checkpoints(tmp_path / "checkpoints", keep=2)
    for step in range(1, 5):
        ckpt.save(_State(jnp.int32(step), {"w": jnp.full((3,), step, jnp.float32)}), {})
    names = sorted(p.name for p in ckpt.directory.iterdir())
    assert ckpt.steps() == [3, 4] and names == ["3", "4"], names
    shutil.copytree(ckpt.directory / "3", ckpt.directory / "1.dropped")
    (ckpt.directory / "1.dropped" / "_CHECKPOINT_METADATA").unlink()
    again = Checkpoints(ckpt.directory, keep=2, create=False)
    assert again.steps() == [3, 4]
    assert again.remove_temporary() == [] and not (ckpt.directory / "1.dropped").exists()
    abstract = _State(jnp.int32(0), {"w": jnp.zeros((3,), jnp.float32)})
    assert again.restore(abstract).params["w"].tolist() == [4.0] * 3


def test_two_processes_drop_the_steps_beyond_keep_together(tmp_path):
    """Over two processes process 0 drops the steps beyond keep and both list the steps again
    after a barrier: a run saving every step with keep=2 ends with steps 3 and 4 only, nothing
    dropped left, every process exiting 0 (a barrier one process skipped would hang)."""
    mp = load_benchmark("_multiprocess")
    (tmp_path / "corpus.txt").write_text("To be, or not to be, that is the question\n" * 60)
    prepared.prepare(
        str(tmp_path / "corpus.txt"), tmp_path / "data", tokenizer="char", progress=False
    )
    config = mp.CONFIG.format(corpus=tmp_path / "corpus.txt", data=tmp_path / "data", steps=4,
                              batch=8)  # fmt: skip
    (tmp_path / "c.yaml").write_text(config)
    args = [str(tmp_path / "c.yaml"), "checkpoint.keep=2", "logging.sample_tokens=0"]
    try:
        run = mp.Run(tmp_path, "run", 2, 2, [*args, "logging.plot=false"]).finish()
    finally:
        mp.kill_all()
    assert sorted(p.name for p in (run.dir / "checkpoints").iterdir()) == ["3", "4"]
