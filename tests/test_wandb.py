"""Weights & Biases logging (`train.wandb: true`), offline, read back from W&B's own run files.

The run is test_tensorboard's (4 steps, checkpoints at 2 and 4), then its crash case of
`--resume`: checkpoint 4 removed, the run resumes from 2 to 6. W&B runs offline
(WANDB_MODE=offline: nothing leaves the machine) with code, git, stats and metadata
collection off. Each session writes RUN/wandb/offline-run-*/run-ID.wandb: W&B's transaction
log (LevelDB log framing around `wandb.proto.wandb_internal_pb2.Record` protobufs), read
here record by record (wandb 0.31 ships no reader for it). ~10-15 s (two compiles of the
2-layer gpt preset, two W&B sessions of ~0.5 s each).
"""

from __future__ import annotations

import json
import shutil
import struct
import sys

import pytest
from test_tensorboard import TEXT, _config

from lmjax import train
from lmjax.errors import ConfigError
from lmjax.train.tensorboard import TAGS
from lmjax.train.wandb_log import WandbLog

OFFLINE = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_X_DISABLE_STATS": "true",
    "WANDB_X_DISABLE_META": "true",
}
BLOCK, HEADER, FULL, LAST = 32768, 7, 1, 4  # the LevelDB log format W&B writes


def _flushed() -> None:
    """Waits until W&B's service has written everything. `run.finish()` returns once the exit
    record is handled, but only *informs* the service that the run is done (wandb 0.31's
    `ServiceConnection.inform_finish` publishes without waiting): the file's last block may
    reach the disk after finish returns (CI once read a file without its exit record).
    `wandb.teardown()` asks the service to shut down and waits for its process to exit, which
    closes every run's file; the next `wandb.init` starts a new service."""
    import wandb

    wandb.teardown()


def _records(path):
    """The protobuf records of one .wandb file: a 7-byte ':W&B' file header, then 32 KiB
    blocks of (crc32, length u16, type u8) chunks; a record is one FULL chunk or
    FIRST + MIDDLE... + LAST; a block tail shorter than a chunk header is padding."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if left < HEADER or (kind == 0 and length == 0):
            pos += left
            continue
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _session(path) -> tuple[str, dict[int, dict]]:
    """(the run id, {step: {key: value}}) of one offline session's .wandb file."""
    run_id, history = None, {}
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # fmt: skip
            history[record.history.step.num] = items
    return run_id, history


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("wandb")
    (root / "corpus.txt").write_text(TEXT)
    on = {"train.wandb": True, "train.tensorboard": False}
    with pytest.MonkeyPatch.context() as env:
        for key, value in OFFLINE.items():
            env.setenv(key, value)
        env.setenv("WANDB_DIR", str(root / "wandb_dir"))  # W&B's own scratch files, if any
        env.setenv("WANDB_CONFIG_DIR", str(root / "wandb_config"))
        env.setenv("WANDB_CACHE_DIR", str(root / "wandb_cache"))
        train.train(_config(root, **on), out=open(root / "log1.txt", "w"))
        shutil.rmtree(root / "run" / "checkpoints" / "4")
        on["train.steps"] = 6
        train.train(_config(root, **on), resume=True, out=open(root / "log2.txt", "w"))
        _flushed()
    return root / "run"


def test_resume_continues_the_same_wandb_run(wandb_run):
    files = sorted(wandb_run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2, files  # one offline session per process run, both under RUN
    stored_id = (wandb_run / "wandb_id").read_text().strip()
    (first_id, first), (second_id, second) = (_session(f) for f in files)
    assert first_id == second_id == stored_id
    assert sorted(first) == [1, 2, 3, 4]
    assert sorted(second) == [3, 4, 5, 6]  # redone from checkpoint 2
    # metrics.jsonl (truncated to checkpoint 2, then steps 3-6 of the resume): steps 1-2 are the
    # first session's, 3-6 the second's, every key at its TensorBoard tag with its value.
    records = train.metrics.MetricsLog(wandb_run / "metrics.jsonl").read()
    compared = 0
    for record in records:
        history = first if record["step"] <= 2 else second
        for key, tag in TAGS.items():
            if record.get(key) is not None:
                assert history[record["step"]][tag] == pytest.approx(record[key], rel=1e-12), tag
                compared += 1
    assert compared >= 6 * 5  # loss, lr, grad norm, tokens/s, data time at least, each step
    assert {"train/loss", "val/loss", "train/mfu"} <= set(second[6])


def test_the_run_config_reaches_wandb(wandb_run):
    config = next(
        r.run.config for f in wandb_run.glob("wandb/offline-run-*/run-*.wandb")
        for r in _records(f) if r.WhichOneof("record_type") == "run"
    )  # fmt: skip
    values = {i.key: json.loads(i.value_json) for i in config.update}
    assert values["train"]["wandb"] is True
    assert values["model"]["preset"] == "gpt"
    assert isinstance(values["model"]["vocab_size"], int)  # resolved from the data (was None)


def test_a_failed_run_is_finished_as_failed(tmp_path, monkeypatch):
    """close() in a `finally` while an exception propagates: the session ends (no hang) with
    exit code 1 in its file. ~1 s (one W&B session)."""
    pytest.importorskip("wandb")
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    log = WandbLog(tmp_path, {"train": {"steps": 1}}, resume=False)
    with pytest.raises(RuntimeError, match="boom"):
        try:
            log.append({"step": 1, "loss": 2.5, "note": "not a scalar"})
            raise RuntimeError("boom")
        finally:
            log.close()
    _flushed()
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    exits = [r.exit.exit_code for r in _records(path) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]
    assert _session(path)[1][1]["train/loss"] == 2.5


def test_without_wandb_installed_the_plan_refuses_before_writing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec -> None, import -> ImportError
    (tmp_path / "corpus.txt").write_text(TEXT)
    with pytest.raises(ConfigError, match="pip install wandb"):
        train.train(_config(tmp_path, **{"train.wandb": True}), out=open(tmp_path / "log", "w"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "log"]


def test_the_wandb_switch_is_off_by_default_and_resumable():
    from lmjax.config import RunConfig
    from lmjax.train.plan import RESUMABLE_CHANGES

    assert RunConfig.from_dict({"model": {"preset": "gpt"}}).train.wandb is False
    assert "train.wandb" in RESUMABLE_CHANGES
