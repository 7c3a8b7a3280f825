"""Full fine-tuning with parameters frozen by name (`lmjax finetune --full --freeze GLOBS`).

- The step (lmjax.finetune.full.full_objective over lmjax.train.finetuned.partition of a tiny
  GQA Llama-shaped model): the optimizer state has no leaf for a frozen parameter; after two
  steps the frozen values are bit-identical and every trained leaf moved; each step's loss and
  new parameters equal a plain reference (jax.grad of a written-out cross-entropy of
  models.forward over the whole tree; the gradient of the trained names alone through the same
  optax transformation), and the
  reference gradient of the frozen leaves is nonzero (so freezing is what kept them).
- The command line on an imported Llama (tests/_llama_run.py): the loss goes down; merged/
  holds the frozen tensors bit for bit and changed trained ones; finetune.yaml records it;
  load_run(RUN) gives merged/'s parameters; bad flags are one line, exit 2, nothing written.

Cost: about 40 s on 2 CPU cores (the CLI run ~25 s; the step test ~5 s).
"""

from __future__ import annotations

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


def test_frozen_leaves_get_no_gradient_no_state_and_stay_bit_identical():
    base = models.init(jax.random.PRNGKey(0), MODEL)
    spec = FinetuneSpec("b", "b", False, None, full=True, freeze=FREEZE)
    init, frozen = parts(spec, base)
    frozen_names = set(ptree.flatten(frozen))
    trained_names = set(ptree.flatten(base)) - frozen_names
    assert "token_embedding.weight" in frozen_names and "blocks.1.attention.key.weight" in (
        trained_names
    )
    tx = optax.sgd(0.1, momentum=0.9)  # has state per leaf; linear in the gradient
    state = init_state(jax.random.PRNGKey(1), MODEL, tx, init)
    assert _names(state.opt_state) == trained_names  # the momentum: trained names only
    assert _names(state.params) == trained_names
    step = make_train_step(MODEL, tx, lambda s: 0.1, loss=full_objective(MODEL))

    ref_params = {k: v for k, v in ptree.flatten(base).items() if k in trained_names}
    ref_opt = tx.init(ref_params)
    rng = np.random.default_rng(0)
    for _ in range(2):
        tokens = jnp.asarray(rng.integers(0, MODEL.vocab_size, (1, 3, MODEL.context_length + 1)))
        batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:]}
        # the reference: plain jax.grad over the whole model, then the trained names' part
        whole = join(ptree.unflatten(ref_params), frozen)
        ref_loss, grads = _reference_grad(whole, batch["inputs"][0], batch["targets"][0])
        flat_grads = ptree.flatten(grads)
        assert all(float(jnp.abs(flat_grads[n]).max()) > 0 for n in frozen_names)
        trained_grads = {k: v for k, v in flat_grads.items() if k in trained_names}
        updates, ref_opt = tx.update(trained_grads, ref_opt, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)

        state, metrics = step(state, batch, frozen)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-6)
        ours = ptree.flatten(state.params)
        for name in trained_names:
            np.testing.assert_allclose(ours[name], ref_params[name], rtol=1e-5, atol=1e-6)

    after = ptree.flatten(join(state.params, frozen))
    before = ptree.flatten(base)
    for name in frozen_names:
        assert np.array_equal(np.asarray(after[name]), np.asarray(before[name])), name
    for name in trained_names:
        assert not np.array_equal(np.asarray(after[name]), np.asarray(before[name])), name


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
