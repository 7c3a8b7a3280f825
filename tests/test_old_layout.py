"""A run saved before the blocks were stacked still resumes, evaluates and exports.

tests/fixtures/per_layer_run was written by lmjax at 02a5c2e (its README.md says how): a
2-layer GPT-2 trained 4 steps, whose checkpoint holds `blocks: {"0": ..., "1": ...}` in the
params and in AdamW's mu and nu, its `lmjax export-hf` output, a weights-only run of the same
params (per-layer `model.safetensors`) and `reference.json` (what that code computed). Each test
works on a copy and checks the one line that says the layout was converted.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lmjax import cli, lora, models, parallel, testing, train
from lmjax import params as ptree
from lmjax.train import optim
from lmjax.train.checkpoint import Checkpoints, layers
from lmjax.train.finetuned import fingerprint
from lmjax.train.step import init_state

FIXTURE = Path(__file__).parent / "fixtures" / "per_layer_run"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
CONVERTED = "was saved with per-layer blocks; converted to the stacked layout on load"
UNCHANGED = "(the files are unchanged; what lmjax saves from it is stacked)"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One XDG cache for every copy: the corpus is prepared once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def copy(tmp_path, cache, monkeypatch):
    """A fresh copy of the fixture, the working directory (its config names corpus.txt)."""
    root = tmp_path / "per_layer_run"
    shutil.copytree(FIXTURE, root)
    monkeypatch.chdir(root)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return root


def _lmjax(capsys, *args: str) -> tuple[str, list[str]]:
    """Run the CLI in-process: (stdout, the stderr lines that report a conversion)."""
    capsys.readouterr()
    assert cli.main(list(args)) == 0
    out, err = capsys.readouterr()
    return out, [line for line in err.splitlines() if "per-layer" in line]


def _abstract(run_dir: Path):
    """The `TrainState` shapes the run's config makes (stacked blocks), nothing allocated."""
    cfg = train.runs.read_config(run_dir)
    tx, _ = optim.from_config(cfg)
    return jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), cfg.model_config(), tx))


def _saved_state(step_dir: Path) -> dict:
    """The step's state as orbax reads it with no target: per-layer, as it was written."""
    return ocp.StandardCheckpointer().restore((step_dir / "state").absolute())


def _assert_equal_trees(ours, theirs):
    flat_ours, flat_theirs = ptree.flatten(ours), ptree.flatten(theirs)
    assert list(flat_ours) == list(flat_theirs)
    for name, leaf in flat_theirs.items():
        np.testing.assert_array_equal(np.asarray(flat_ours[name]), np.asarray(leaf), name)


def _assert_resumed_losses(metrics: Path, step: int, key: str) -> None:
    """The losses and validation losses logged after `step` against the old code's own resume
    (`REFERENCE[key + "_losses"]`, `[key + "_val_losses"]`), which ran the blocks unrolled; this
    one scans them. Float32 round-off only (the same ops, XLA free to fuse them otherwise): 64
    ulps of the loss, 2**-17 relative."""
    records = train.metrics.MetricsLog(metrics).read()
    for field, theirs in (
        ("loss", REFERENCE[f"{key}_losses"]),
        ("val_loss", REFERENCE[f"{key}_val_losses"]),
    ):
        ours = {str(r["step"]): r[field] for r in records if field in r and r["step"] > step}
        assert ours.keys() == theirs.keys(), field
        np.testing.assert_allclose([ours[k] for k in theirs], list(theirs.values()), rtol=2**-17)


def test_the_converted_state_is_the_saved_one(copy, capsys):
    run = train.load_run("run")
    assert capsys.readouterr().err.count(CONVERTED) == 1
    state = Checkpoints(copy / "run/checkpoints", create=False).restore(_abstract(copy / "run"))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"lmjax: {copy / 'run/checkpoints/4'} {CONVERTED} (the files are unchanged; what lmjax "
        "saves from it is stacked)"
    ]
    saved = _saved_state(copy / "run/checkpoints/4")
    assert set(saved["params"]["blocks"]) == {"0", "1"}  # what the fixture is
    # params, and AdamW's moments (which mirror them), stacked exactly; the rest as it was.
    _assert_equal_trees(state.params, ptree.stack(saved["params"]))
    adam = state.opt_state[1][0]
    for moment in ("mu", "nu"):
        _assert_equal_trees(getattr(adam, moment), ptree.stack(saved["opt_state"][1][0][moment]))
    assert int(adam.count) == int(saved["opt_state"][1][0]["count"]) == 4
    assert int(state.step) == int(saved["step"]) == 4
    np.testing.assert_array_equal(np.asarray(state.key), np.asarray(saved["key"]))
    _assert_equal_trees(run.params, state.params)
    # The leaves are the stacked layout's, layer i at index i (checked without `stack` too), and
    # a fine-tune's record of this base still matches.
    query = state.params["blocks"]["attention"]["query"]["weight"]
    assert query.shape == (2, 8, 8)
    for i in (0, 1):
        saved_query = saved["params"]["blocks"][str(i)]["attention"]["query"]["weight"]
        np.testing.assert_array_equal(np.asarray(query[i]), np.asarray(saved_query))
    assert fingerprint(run.params) == REFERENCE["fingerprint"]


def test_a_sharded_state_restores_with_its_shardings(copy, capsys):
    """The trainer restores onto its mesh: each layer is read with the stacked leaf's sharding
    less its layer axis, and the stacked leaves come back with the expected shardings."""
    mesh = parallel.make_mesh({"fsdp": 1})  # as the trainer's (Auto axes)

    def place(leaf):  # the last axis split over fsdp (a size-1 mesh: any size divides)
        spec = P(*[None] * (leaf.ndim - 1), "fsdp") if leaf.ndim else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    abstract = jax.tree.map(place, _abstract(copy / "run"))
    target = layers.per_layer_target(abstract)
    query = target.opt_state[1][0].mu["blocks"]["1"]["attention"]["query"]["weight"]
    assert query.shape == (8, 8) and query.sharding.spec == P(None, "fsdp")
    state = Checkpoints(copy / "run/checkpoints", create=False).restore(abstract)
    assert capsys.readouterr().err.count(CONVERTED) == 1
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(abstract), strict=True):
        assert leaf.shape == want.shape and leaf.sharding == want.sharding


def test_a_weights_run_loads_stacked_and_equal(copy, capsys):
    run = train.load_run("weights")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmjax: weights/model.safetensors {CONVERTED}")
    theirs = safetensors.numpy.load_file("weights/model.safetensors")
    assert "blocks.1.attention.query.weight" in theirs  # per-layer, as written
    _assert_equal_trees(run.params, ptree.stack(ptree.unflatten(theirs)))
    # The trained run's newest checkpoint is the same step: the same parameters.
    _assert_equal_trees(train.load_run("run").params, run.params)


def test_resume_converts_once_and_continues_as_the_old_code_did(copy, capsys):
    args = ["train", "tiny.yaml", "run.dir=run", "--resume", "train.steps=6", "checkpoint.every=2"]
    out, lines = _lmjax(capsys, *args)
    assert "resumed run from step 4" in out
    assert len(lines) == 1 and lines[0].startswith(
        f"lmjax: {copy / 'run/checkpoints/4'} {CONVERTED}"
    )
    assert Checkpoints(copy / "run/checkpoints", create=False).steps() == [6]  # keep: 1
    names = ptree.flatten(_saved_state(copy / "run/checkpoints/6")["params"])
    assert "blocks.attention.query.weight" in names and not any(".0." in n for n in names)
    _assert_resumed_losses(copy / "run/metrics.jsonl", 4, "resumed")
    # Saved stacked: loading it again converts nothing.
    _, lines = _lmjax(capsys, "eval", "run")
    assert lines == []


def test_eval_prints_the_old_loss(copy, capsys):
    out, lines = _lmjax(capsys, "eval", "run")
    assert len(lines) == 1 and CONVERTED in lines[0]
    assert f"run step 4: {REFERENCE['eval']}" in out


def test_export_writes_the_old_export_byte_for_byte(copy, capsys):
    out, lines = _lmjax(capsys, "export-hf", "run", "--out", "again")
    assert len(lines) == 1 and CONVERTED in lines[0]
    for name in ("model.safetensors", "config.json"):
        assert (copy / "again" / name).read_bytes() == (copy / "hf" / name).read_bytes(), name


def test_the_fixture_is_unchanged_by_loading(copy, capsys):
    before = {p: p.read_bytes() for p in sorted(copy.rglob("*")) if p.is_file()}
    train.load_run("run")
    train.load_run("weights")
    after = {p: p.read_bytes() for p in sorted(copy.rglob("*")) if p.is_file()}
    assert after == before
    assert len(before) > 30  # every file of the fixture


def test_old_adapters_load_stacked_and_compute_what_they_computed(copy, capsys):
    """`adapters/adapters.safetensors`, LoRA adapters saved per layer by the same old code (a
    projection in every layer, two in layer 1 only; `adapters/write_adapters.py`): loaded
    against today's stacked adapters with one line saying so, they merge into the very
    parameters `W + s B A` of the file's own tensors (float32 rounding of a float64 witness) and
    give the old code's logits with the adapters attached, to the forward pass's rounding."""
    reference = json.loads((copy / "adapters" / "reference.json").read_text())
    path = Path("adapters/adapters.safetensors")
    run = train.load_run("weights")
    _, lcfg = lora.load_adapters(path)  # no model to stack against: names kept, no line
    expected = jax.eval_shape(lambda: lora.init(jax.random.PRNGKey(0), run.params, lcfg))
    capsys.readouterr()
    adapters, _ = lora.load_adapters(path, expected)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"lmjax: {path} {CONVERTED} (the files are unchanged; what lmjax saves from it is stacked)"
    ]
    assert all(
        name.startswith("blocks.") and not name.split(".")[1].isdecimal()
        for name in ptree.flatten(adapters)
    )
    # The merge against float64 `W + s B A` from the file's own per-layer tensors: float32
    # rounds W, the r = 2 products and their sum, each within half an ulp of what it rounds, so
    # 4 * eps32 * (|W| + s |B| |A|) bounds it on any CPU (FMA or not). Layers a projection was
    # not targeted in keep W bit for bit.
    merged = ptree.flatten(ptree.unstack(lora.merge(run.params, adapters, lcfg)))
    base = ptree.flatten(ptree.unstack(run.params))
    saved = safetensors.numpy.load_file(path)
    eps = float(np.finfo(np.float32).eps)
    for name, w in base.items():
        layer = name.removesuffix(".weight")
        if f"{layer}.lora_a" not in saved:
            np.testing.assert_array_equal(merged[name], w, err_msg=name)
            continue
        a, b = (saved[f"{layer}.lora_{k}"].astype(np.float64) for k in "ab")
        w64 = np.asarray(w, np.float64)
        bound = 4 * eps * (np.abs(w64) + lcfg.scale * np.abs(b) @ np.abs(a))
        err = np.abs(np.asarray(merged[name], np.float64) - (w64 + lcfg.scale * b @ a))
        assert (err <= bound).all(), (name, float(err.max()))
    tokens = np.asarray(reference["tokens"], np.int32)
    logits = models.forward(lora.attach(run.params, adapters, lcfg), tokens, run.model)
    theirs = np.asarray(reference["logits"])
    np.testing.assert_allclose(logits, theirs, rtol=0, atol=testing.logits_atol(run.model, theirs))


def test_a_partly_frozen_full_fine_tune_resumes_as_the_old_code_did(copy, cache, capsys):
    """`full_ft/`: a full fine-tune of `run` with `blocks.0.*` frozen, saved at step 2 by the
    old code, whose trained state held layer 1 of each block leaf only (per layer, nothing of
    a frozen layer). Resumed to step 4 it is converted once (layer 0 restored as the zeros the
    stacked layout trains in a frozen layer) and logs the old code's own resumed losses; its
    merged export keeps layer 0 of the base bit for bit."""
    stored = _saved_state(copy / "full_ft/checkpoints/2")
    names = ptree.flatten(stored["params"])
    assert "blocks.1.attention.query.weight" in names
    assert not any(n.startswith("blocks.0.") for n in names)
    # The fine-tune recorded its prepared corpus under the cache it ran with: this test's.
    config = copy / "full_ft/config.yaml"
    recorded = re.search(r"dir: (\S+)/lmjax/data/", config.read_text()).group(1)
    config.write_text(config.read_text().replace(recorded, str(cache)))
    args = ["finetune", "full_ft.yaml", "run.dir=full_ft", "--resume", "train.steps=4"]
    out, lines = _lmjax(capsys, *args, "checkpoint.every=2")
    assert "resumed full_ft from step 2" in out
    # Each converted once: the base it joins (still per layer) and the fine-tune's own step.
    assert lines == [
        f"lmjax: {copy / where} {CONVERTED} {UNCHANGED}"
        for where in ("run/checkpoints/4", "full_ft/checkpoints/2")
    ]
    _assert_resumed_losses(copy / "full_ft/metrics.jsonl", 2, "full_ft_resumed")
    base = ptree.flatten(ptree.unstack(train.load_run("run").params))
    merged = ptree.flatten(ptree.unstack(train.load_run("full_ft/merged").params))
    for name, value in base.items():
        frozen = name.startswith("blocks.0.")
        assert np.array_equal(np.asarray(merged[name]), np.asarray(value)) == frozen, name
