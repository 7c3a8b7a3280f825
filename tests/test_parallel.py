"""lmjax.parallel on the devices jax sees, one or several (it passes with and without
XLA_FLAGS=--xla_force_host_platform_device_count=8): mesh config validation, the rules on
sizes alone, multi-host start-up from the environment, and a non-zero process writing nothing.
(The 8-device tests are in test_parallel_mesh.py.)"""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as PS

from lmjax import cli, models, parallel
from lmjax.config import RunConfig
from lmjax.errors import ConfigError
from lmjax.parallel import multihost

MODEL = {"preset": "llama", "vocab_size": 64}


def run_config(mesh, batch_size=8, grad_accum=1):
    return RunConfig.from_dict(
        {
            "model": MODEL,
            "train": {"batch_size": batch_size, "grad_accum": grad_accum},
            "parallel": {"mesh": mesh},
        }
    )


def test_mesh_section_is_optional_and_kept():
    assert RunConfig.from_dict({"model": MODEL}).parallel.mesh is None
    cfg = run_config({"data": 2, "fsdp": 4})
    assert cfg.to_dict()["parallel"] == {"mesh": {"data": 2, "fsdp": 4}}


@pytest.mark.parametrize(
    ("mesh", "words"),
    [
        ({"dat": 2}, ["'dat'", "one of ('data', 'fsdp', 'model')"]),
        ({"data": 0}, ["parallel.mesh.data = 0", ">= 1"]),
        ({"fsdp": -2}, ["parallel.mesh.fsdp = -2"]),
        ({"model": 1.5}, ["parallel.mesh.model = 1.5"]),
        ({"data": True}, ["parallel.mesh.data = True"]),
        ([2, 4], ["parallel.mesh", "a mapping"]),
        ({"data": 3}, ["train.batch_size = 8", "multiple of data x fsdp = 3"]),
    ],
)
def test_bad_mesh_sections_name_the_value_and_the_fix(mesh, words):
    with pytest.raises(ConfigError) as err:
        run_config(mesh)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "Fix:" in str(err.value)


def test_mesh_override_as_text():
    cfg = RunConfig.from_dict(
        {"model": MODEL, "train": {"batch_size": 8}}, {"parallel.mesh": "fsdp=4,model=2"}
    )
    assert cfg.parallel.mesh == {"fsdp": 4, "model": 2}
    with pytest.raises(ConfigError, match="parallel.mesh item = 'fsdp4'"):
        RunConfig.from_dict({"model": MODEL}, {"parallel.mesh": "fsdp4"})


def test_micro_batch_must_split_over_data_and_fsdp():
    run_config({"data": 2, "fsdp": 2}, batch_size=8, grad_accum=2)  # 4 per micro-batch: fine
    with pytest.raises(ConfigError, match="multiple of data x fsdp = 4"):
        run_config({"data": 2, "fsdp": 2}, batch_size=8, grad_accum=4)  # 2 per micro-batch


def test_device_count_must_equal_the_product():
    with pytest.raises(ConfigError) as err:
        parallel.check_mesh_shape({"data": 2, "fsdp": 4}, n_devices=1)
    text = str(err.value)
    assert "data=2,fsdp=4,model=1" in text and "1 devices" in text and "got 8" in text


def test_parse_mesh_arg():
    assert parallel.parse_mesh_arg("data=2, fsdp=4") == {"data": 2, "fsdp": 4, "model": 1}
    for bad in ("data", "data=x", "data=2,foo=1", "model=0"):
        with pytest.raises(ConfigError):
            parallel.parse_mesh_arg(bad)


def test_rules_from_logical_axes():
    mesh = {"data": 1, "fsdp": 4, "model": 2}
    # [heads, embed] column-parallel; [embed, mlp] row-parallel; vocab replicated.
    assert parallel.spec_for((32, 64), ("heads", "embed"), mesh) == PS("model", "fsdp")
    assert parallel.spec_for((64, 96), ("embed", "mlp"), mesh) == PS("fsdp", "model")
    assert parallel.spec_for((50257, 64), ("vocab", "embed"), mesh) == PS(None, "fsdp")
    # Indivisible dims replicate: 50257 is odd, d_model 6 on fsdp=4.
    assert parallel.spec_for((6,), ("embed",), mesh) == PS(None)
    assert parallel.spec_for((36, 6), ("mlp", "embed"), {**mesh, "model": 8}) == PS(None, None)
    # Size-1 axes are left out.
    assert parallel.spec_for((32, 64), ("heads", "embed"), {"data": 8, "fsdp": 1, "model": 1}) == (
        PS(None, None)
    )


def test_every_declared_parameter_gets_a_rule_and_indivisible_dims_are_listed():
    cfg = models.preset("gpt", vocab_size=65, d_ff=36)
    mesh = {"data": 1, "fsdp": 4, "model": 8}
    specs = parallel.param_specs(cfg, mesh)
    assert specs.keys() == models.declare(cfg).keys()
    lines = parallel.describe(cfg, mesh)
    ragged = [line for line in lines if "replicated" in line]
    assert ragged and all("mlp=36 not divisible by model=8" in line for line in ragged)


def test_shard_shape_and_bytes():
    mesh = {"data": 2, "fsdp": 4, "model": 2}
    assert parallel.shard_shape((8, 12), PS("model", "fsdp"), mesh) == (4, 3)
    assert parallel.shard_shape((8, 12), PS(("data", "fsdp")), mesh) == (1, 12)
    cfg = models.preset("llama", vocab_size=64)
    params = models.abstract_params(cfg)
    one = parallel.per_device_bytes(params, parallel.state_specs(params, cfg, mesh), mesh)
    full = sum(s.size for s in models.declare(cfg).values()) * 4
    # Every llama weight here is divisible, so each leaf is split 4x (fsdp) or 8x (fsdp x model).
    assert full / 8 <= one <= full / 4


def test_distributed_args_from_the_environment():
    assert multihost.distributed_args({}) is None
    # jax's own heartbeat timeout, 4 x lmjax's (50 s by default), whoever names the hosts
    assert multihost.distributed_args({"LMJAX_DISTRIBUTED": "auto"}) == {
        "heartbeat_timeout_seconds": 200
    }
    env = {
        "LMJAX_COORDINATOR": "10.0.0.1:1234",
        "LMJAX_NUM_PROCESSES": "4",
        "LMJAX_PROCESS_ID": "3",
    }
    assert multihost.distributed_args(env) == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 3,
        "heartbeat_timeout_seconds": 200,
    }
    with pytest.raises(ConfigError, match="LMJAX_PROCESS_ID = 4"):
        multihost.distributed_args({**env, "LMJAX_PROCESS_ID": "4"})
    with pytest.raises(ConfigError, match="LMJAX_NUM_PROCESSES"):
        multihost.distributed_args({"LMJAX_COORDINATOR": "h:1"})


def test_initialize_calls_jax_distributed_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(multihost.jax.distributed, "initialize", lambda **kw: calls.append(kw))
    assert not multihost.initialize_from_env({})
    assert multihost.initialize_from_env({"LMJAX_DISTRIBUTED": "auto"})
    assert calls == [{"heartbeat_timeout_seconds": 200}]


# One layer: the tests read what a run writes and when it fails, not what it computes.
CONFIG = """
model: {{preset: llama, vocab_size: null, context_length: 16, n_layers: 1}}
data: {{corpus: {corpus}, tokenizer: char}}
schedule: {{warmup_steps: 1}}
train: {{steps: 2, batch_size: 2, seq_len: 8, eval_every: 2, eval_batches: 1}}
checkpoint: {{every: 1}}
logging: {{every: 1, progress: false, sample_tokens: 2, sample_prompt: a, peak_flops: 1.0e+12}}
run: {{dir: {run}}}
"""


@pytest.mark.slow  # a short lmjax train (~10 s of CPU)
def test_a_process_other_than_zero_writes_only_checkpoints(tmp_path, monkeypatch):
    (tmp_path / "corpus.txt").write_text("a quick brown fox jumps over the lazy dog\n" * 40)
    run = tmp_path / "run"
    (tmp_path / "c.yaml").write_text(CONFIG.format(corpus=tmp_path / "corpus.txt", run=run))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(parallel, "is_main", lambda: False)
    assert cli.main(["train", str(tmp_path / "c.yaml")]) == 0
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1", "2"]


def test_barrier_waits_only_with_several_processes(monkeypatch):
    from jax.experimental import multihost_utils

    calls = []
    monkeypatch.setattr(multihost_utils, "sync_global_devices", calls.append)
    multihost.barrier("one")
    assert calls == []
    monkeypatch.setattr(multihost.jax, "process_count", lambda: 2)
    multihost.barrier("two")
    assert calls == ["two"]


@pytest.mark.parametrize(
    ("env", "words"),
    [
        # Ranks without a coordinator used to mean "one process": every host then trained
        # alone and wrote the run directory as process 0.
        ({"LMJAX_NUM_PROCESSES": "4", "LMJAX_PROCESS_ID": "1"}, ["LMJAX_COORDINATOR"]),
        ({"LMJAX_PROCESS_ID": "0"}, ["LMJAX_COORDINATOR"]),
        ({"LMJAX_DISTRIBUTED": "1"}, ["LMJAX_DISTRIBUTED = '1'", "auto"]),
        ({"LMJAX_DISTRIBUTED": "auto", "LMJAX_COORDINATOR": "h:1"}, ["not both"]),
        ({"LMJAX_COORDINATOR": "h", "LMJAX_NUM_PROCESSES": "2", "LMJAX_PROCESS_ID": "0"},
         ["LMJAX_COORDINATOR = 'h'", "host:port"]),
    ],
)  # fmt: skip
def test_partial_or_unknown_distributed_variables_are_config_errors(env, words):
    with pytest.raises(ConfigError) as err:
        multihost.distributed_args(env)
    assert all(w in str(err.value) for w in words), str(err.value)


START_UP = """
import sys
import jax
from jax._src import xla_bridge

def initialize(**kwargs):  # exit 10: before any device use, as jax.distributed requires
    sys.exit(11 if xla_bridge.backends_are_initialized() else 10)

jax.distributed.initialize = initialize
from lmjax import cli
sys.exit(cli.main(["train", sys.argv[1]]))
"""


def test_lmjax_train_initializes_jax_distributed_before_touching_a_device(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "c.yaml").write_text(CONFIG.format(corpus=tmp_path / "none.txt", run=tmp_path))
    env = {**os.environ, "LMJAX_DISTRIBUTED": "auto", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", START_UP, str(tmp_path / "c.yaml")], env=env, capture_output=True
    )
    assert done.returncode == 10, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("mesh", "words"),
    [
        ("fsdp=0", "--mesh.fsdp = 0"),
        ("dat=2", "--mesh axis = 'dat'"),
        ("fsdp", "--mesh item = 'fsdp'"),
        ("fsdp=4,model=x", "--mesh item = 'model=x'"),
        ("data=2,data=4", "--mesh axis = 'data'"),  # given twice: was the last one, silently
    ],
)
def test_inspect_bad_mesh_is_one_line_and_exit_2_before_any_output(mesh, words, capsys):
    assert cli.main(["inspect", "llama", "--mesh", mesh]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and words in err, err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["llama", "--mesh", "data=2,fsdp=4", "--batch-size", "3"], "--batch-size = 3"),
        # the config's batch of 32 sequences does not split over data=3
        (["configs/tiny-shakespeare.yaml", "--mesh", "data=3"], "micro-batch) = 32"),
    ],
)
def test_inspect_a_batch_the_mesh_cannot_split_is_refused_before_any_output(
    args, words, capsys, monkeypatch
):
    """It used to print the whole summary first and fail at the per-device table, and a char
    config fetched and prepared the corpus (for its vocab) before saying so."""
    from lmjax import train
    from lmjax.data import prepared

    def no_data(*_a, **_k):
        raise AssertionError("inspect prepared the data before checking the batch")

    monkeypatch.setattr(train, "prepare_data", no_data)
    monkeypatch.setattr(prepared, "known_vocab_size", no_data)
    config_dir = Path(__file__).parent.parent
    args = [str(config_dir / a) if a.endswith(".yaml") else a for a in args]
    assert cli.main(["inspect", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and words in err, err


def test_a_mesh_the_devices_do_not_fit_is_refused_before_the_run_directory_is_written(
    tmp_path, monkeypatch, capsys
):
    """It was found when the mesh was built, after config.yaml and the tokenizer were written,
    so the corrected command then refused the run directory as an existing run."""
    (tmp_path / "corpus.txt").write_text("a quick brown fox jumps over the lazy dog\n" * 40)
    run = tmp_path / "run"
    (tmp_path / "c.yaml").write_text(CONFIG.format(corpus=tmp_path / "corpus.txt", run=run))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    n = jax.device_count()  # 1 here, 8 under XLA_FLAGS=--xla_force_host_platform_device_count=8
    mesh = [f"parallel.mesh=data={2 * n}", f"train.batch_size={2 * n}"]  # the batch fits it
    assert cli.main(["train", str(tmp_path / "c.yaml"), *mesh]) == 2
    assert f"product equals the {n} devices" in capsys.readouterr().err
    assert not run.exists() or not any(run.iterdir())
