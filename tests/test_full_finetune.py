"""Full fine-tuning with parameters frozen by name (`lmjax finetune --full --freeze GLOBS`).

- The step (lmjax.finetune.full.full_objective over lmjax.train.finetuned.partition of a tiny
  GQA Llama-shaped model, `blocks.0.*` freezing layer 0 of every stacked block leaf): the
  optimizer state has no leaf for a wholly frozen parameter; after two steps the frozen values
  (per layer) are bit-identical and every trained one moved; each step's loss and new
  parameters equal a plain reference over per-layer leaves, the layout before the blocks were
  stacked (jax.grad of a written-out cross-entropy of models.forward over the whole tree; the
  gradient of the trained per-layer names alone through the same optax transformation, global
  norm clipping included), and the reference gradient of the frozen leaves is nonzero (so
  freezing is what kept them). AdamW's weight decay leaves a partly frozen leaf's frozen slice
  alone, and decays by layer where a `no_decay` glob exempts some layers.
- The command line on an imported Llama (tests/_llama_run.py): the loss goes down; merged/
  holds the frozen tensors bit for bit and changed trained ones; finetune.yaml records it;
  load_run(RUN) gives merged/'s parameters; bad flags are one line, exit 2, nothing written.

Cost: about 40 s on 2 CPU cores (the CLI run ~25 s; the step test ~5 s).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _llama_run import finetune_config, imported_run

from lmjax import cli, models
from lmjax import params as ptree
from lmjax.finetune.full import full_objective
from lmjax.io import safetensors
from lmjax.train.finetuned import FinetuneSpec, join, parts
from lmjax.train.runs import load_run
from lmjax.train.step import init_state, make_train_step

FREEZE = ("token_embedding.*", "blocks.0.*")
MODEL = models.ModelConfig(
    vocab_size=64, context_length=16, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
    d_ff=64, norm="rmsnorm", activation="swiglu", positions="rope", bias=False,
    tie_embeddings=False,
)  # fmt: skip


def _names(tree) -> set[str]:
    """Every leaf's name, from the dict keys on its path (optimizer states nest the trees)."""
    out = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if keys:
            out.add(".".join(keys))
    return out


def _cross_entropy(params, inputs_BT, targets_BT):
    """The mean next-token NLL, written out: log_softmax of models.forward's logits."""
    logp = jax.nn.log_softmax(models.forward(params, inputs_BT, MODEL), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets_BT[..., None], axis=-1))


_reference_grad = jax.jit(jax.value_and_grad(_cross_entropy))


def _per_layer(tree) -> dict:
    """`{per-layer name: array}` (`blocks.1.attention.key.weight`): the layout each layer's
    leaves had before the blocks were stacked."""
    return ptree.flatten(ptree.unstack(tree))


def test_frozen_leaves_get_no_gradient_no_state_and_stay_bit_identical():
    """`blocks.0.*` freezes layer 0 of every stacked block leaf: each step equals the old
    semantics, where every layer's leaf trained or froze on its own (a reference over per-layer
    leaves: jax.grad of the whole model, the trained per-layer names' part through the same
    optax transformation, clipping by their global norm included)."""
    base = models.init(jax.random.PRNGKey(0), MODEL)
    spec = FinetuneSpec("b", "b", False, None, full=True, freeze=FREEZE)
    init, frozen = parts(spec, base)
    per_layer = _per_layer(base)
    frozen_names = {n for n in per_layer if ptree.matches(n, FREEZE)}  # as a user reads them
    trained_names = set(per_layer) - frozen_names
    assert "token_embedding.weight" in frozen_names and "blocks.0.attention.key.weight" in (
        frozen_names
    )
    assert "blocks.1.attention.key.weight" in trained_names
    # Whole leaves frozen: no gradient, no state. Leaves frozen in layer 0 only: in both trees.
    stacked = {n for n in ptree.flatten(base) if ptree.is_stacked(n)}
    assert set(ptree.flatten(frozen)) == {"token_embedding.weight"} | stacked
    # A small clip: the norm of the trained slices alone decides each step's scale.
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1, momentum=0.9))
    state = init_state(jax.random.PRNGKey(1), MODEL, tx, init)
    trained_leaves = set(ptree.flatten(base)) - {"token_embedding.weight"}
    assert _names(state.opt_state) == trained_leaves == _names(state.params)
    step = make_train_step(MODEL, tx, lambda s: 0.1, loss=full_objective(MODEL, FREEZE))

    ref_params = {k: v for k, v in per_layer.items() if k in trained_names}
    ref_opt = tx.init(ref_params)
    rng = np.random.default_rng(0)
    for _ in range(2):
        tokens = jnp.asarray(rng.integers(0, MODEL.vocab_size, (1, 3, MODEL.context_length + 1)))
        batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}
        # the reference: plain jax.grad over the whole model, then the trained names' part
        whole = ptree.stack(ptree.unflatten(ref_params | {n: per_layer[n] for n in frozen_names}))
        ref_loss, grads = _reference_grad(whole, batch["inputs"][0], batch["targets"][0])
        flat_grads = _per_layer(grads)
        assert all(float(jnp.abs(flat_grads[n]).max()) > 0 for n in frozen_names)
        trained_grads = {k: v for k, v in flat_grads.items() if k in trained_names}
        assert optax.tree.norm(trained_grads) > 0.05  # so the clip acts
        updates, ref_opt = tx.update(trained_grads, ref_opt, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)

        state, metrics = step(state, batch, frozen)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-6)
        ours = _per_layer(state.params)
        for name in trained_names:
            np.testing.assert_allclose(ours[name], ref_params[name], rtol=1e-5, atol=1e-6)
        for name in frozen_names - {"token_embedding.weight"}:  # the trained copy's zeros
            assert not np.asarray(ours[name]).any(), name

    after = _per_layer(join(state.params, frozen, FREEZE))
    for name in frozen_names:
        assert np.array_equal(np.asarray(after[name]), np.asarray(per_layer[name])), name
    for name in trained_names:
        assert not np.array_equal(np.asarray(after[name]), np.asarray(per_layer[name])), name


def test_adamw_weight_decay_leaves_partly_frozen_slices_alone():
    """lmjax's AdamW (weight decay on block weights, clipping) over a leaf frozen in layer 0:
    the trained copy's frozen slice stays exactly zero, the model's stays the base's; with
    `blocks.0.*` in `no_decay` instead, layer 0 trains undecayed (decay by layer)."""
    from lmjax.config import OptimizerConfig
    from lmjax.train import optim

    base = models.init(jax.random.PRNGKey(0), MODEL)
    spec = FinetuneSpec("b", "b", False, None, full=True, freeze=("blocks.0.*",))
    init, frozen = parts(spec, base)
    opt = OptimizerConfig(lr=1e-2, weight_decay=0.5)
    tx = optim.optimizer(opt, lambda s: 1e-2)
    state = init_state(jax.random.PRNGKey(1), MODEL, tx, init)
    step = make_train_step(MODEL, tx, lambda s: 1e-2, loss=full_objective(MODEL, spec.freeze))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 2, 17)))
    batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}
    for _ in range(2):
        state, _ = step(state, batch, frozen)
    key = "blocks.attention.key.weight"
    ours, before = ptree.flatten(state.params)[key], ptree.flatten(base)[key]
    assert not np.asarray(ours[0]).any() and not np.array_equal(ours[1], before[1])
    joined = ptree.flatten(join(state.params, frozen, spec.freeze))[key]
    assert np.array_equal(joined[0], before[0]) and np.array_equal(joined[1], ours[1])

    # Decay by layer: with zero gradients, AdamW moves a weight by -lr * wd * w exactly where
    # it decays, and not at all where a no_decay glob exempts the layer.
    params = {"blocks": {"attention": {"key": {"weight": before}}}}
    exempt = optim.optimizer(
        dataclasses.replace(opt, no_decay=("blocks.0.*",), clip_norm=None), lambda s: 1e-2
    )
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = exempt.update(zero, exempt.init(params), params)
    u = updates["blocks"]["attention"]["key"]["weight"]
    assert not np.asarray(u[0]).any()
    np.testing.assert_array_equal(u[1], -1e-2 * (0.5 * before[1]))


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_finetune")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        imported_run(root)
        finetune_config(root)
        yield root


def test_cli_full_finetune_of_an_imported_llama(ws):
    out = ws / "out"
    freeze = ",".join(FREEZE)
    args = ["finetune", str(ws / "ft.yaml"), f"run.dir={out}", "--full", "--freeze", freeze]
    assert cli.main(args) == 0
    losses = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    assert not (out / "adapters.safetensors").exists()
    base = safetensors.load(ws / "base" / "model.safetensors")
    merged = safetensors.load(out / "merged" / "model.safetensors")
    flat_base, flat_merged = ptree.flatten(base), ptree.flatten(merged)
    assert flat_base.keys() == flat_merged.keys()
    for name, value in flat_base.items():
        same = np.array_equal(np.asarray(value), np.asarray(flat_merged[name]))
        assert same == ptree.matches(name, FREEZE), name
    spec = (out / "finetune.yaml").read_text()
    assert "full: true" in spec and "lora: null" in spec
    loaded = ptree.flatten(load_run(out).params)
    for name, value in flat_merged.items():
        assert np.array_equal(np.asarray(loaded[name]), np.asarray(value)), name


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--freeze", "blocks.0.*"], "--freeze"),
        (["--full", "--qlora"], "qlora"),
        (["--full", "--lora", "r=4"], "LoRA settings"),
        (["--full", "--freeze", "blocks.9.*"], "blocks.9.*"),
        (["--full", "--freeze", "*"], "at least one parameter to train"),
    ],
)
def test_bad_full_flags_are_one_line(ws, flags, says, capsys):
    out = ws / "bad"
    assert cli.main(["finetune", str(ws / "ft.yaml"), f"run.dir={out}", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not out.exists()
