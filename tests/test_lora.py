"""LoRA (SPEC section 6): adapters against peft on a tiny Hugging Face GPT-2, peft's init bounds,
merge/unmerge, adapter files, and training only the adapters (base bit-identical).

Witnesses: `peft` (LoRA on GPT-2's Conv1D layers, logits compared within
`lmjax.testing.logits_atol`, a derived float32 bound),
`torch.nn.init.kaiming_uniform_(a=sqrt(5))` for the init bound, and the gradient of the merged
weight `W + s B A` (plain `jax.grad`) for the adapter gradients.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lmjax import lora, models, testing
from lmjax import params as ptree
from lmjax.errors import ConfigError, FileFormatError, ShapeError
from lmjax.train.step import init_state, make_train_step

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

D, N_LAYERS, V, C, R = 32, 2, 64, 16, 4
HF_CONFIG = dict(
    vocab_size=V, n_positions=C, n_embd=D, n_layer=N_LAYERS, n_head=4,
    activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip
TOKENS = np.random.default_rng(0).integers(0, V, size=(2, C))


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A tiny random GPT-2 saved to disk, and lmjax's import of it."""
    from lmjax.io import hf_gpt2

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**HF_CONFIG)).eval()
    out = tmp_path_factory.mktemp("hf_lora")
    model.save_pretrained(out)
    params, cfg = hf_gpt2.load(out)
    return out, params, cfg


def _peft_model(path, **lora_kwargs):
    torch.manual_seed(1)
    base = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    config = peft.LoraConfig(
        r=R, lora_alpha=8, lora_dropout=0.0, fan_in_fan_out=True, **lora_kwargs
    )
    model = peft.get_peft_model(base, config).eval()
    with torch.no_grad():  # B starts at zero: make the adapters do something
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.2 * torch.randn_like(param))
    return model


def _weights(model) -> dict[str, np.ndarray]:
    """`{(block, hf_module): (A [r, in], B [out, r])}` of a peft GPT-2."""
    out = {}
    for name, param in model.named_parameters():
        if "lora_" not in name:
            continue
        parts = name.split(".")
        block = parts[parts.index("h") + 1]
        module = ".".join(parts[parts.index("h") + 2 : parts.index("h") + 4])  # attn.c_attn
        which = "a" if "lora_A" in name else "b"
        out.setdefault((block, module), {})[which] = param.detach().numpy()
    return out


_ONE_TO_ONE = {
    "attn.c_proj": "attention.output",
    "mlp.c_fc": "feed_forward.expand",
    "mlp.c_proj": "feed_forward.project",
}


def _to_lmjax(peft_weights) -> dict:
    """peft's adapters as lmjax adapters. `c_attn` is q|k|v fused: one A shared by the three
    projections and B split by rows, which lmjax's per-projection adapters express exactly."""
    flat = {}
    for (block, module), w in peft_weights.items():
        a, b = w["a"], w["b"]
        if module == "attn.c_attn":
            for j, proj in enumerate(("query", "key", "value")):
                flat[f"blocks.{block}.attention.{proj}.lora_a"] = a
                flat[f"blocks.{block}.attention.{proj}.lora_b"] = b[j * D : (j + 1) * D]
        else:
            flat[f"blocks.{block}.{_ONE_TO_ONE[module]}.lora_a"] = a
            flat[f"blocks.{block}.{_ONE_TO_ONE[module]}.lora_b"] = b
    return ptree.unflatten({k: jnp.asarray(v) for k, v in flat.items()})


@pytest.mark.parametrize("rslora", [False, True])
def test_same_adapter_weights_give_peft_logits(hf_base, rslora):
    path, params, cfg = hf_base
    model = _peft_model(path, target_modules=["c_attn", "c_proj", "c_fc"], use_rslora=rslora)
    with torch.no_grad():
        theirs = model(torch.tensor(TOKENS)).logits.numpy()
    adapters = _to_lmjax(_weights(model))
    lcfg = lora.LoraConfig(r=R, alpha=8, targets="all-linear", rslora=rslora)
    assert lora.adapter_layers(adapters).keys() == lora.target_layers(cfg, lcfg).keys()
    ours = np.asarray(models.forward(lora.attach(params, adapters, lcfg), TOKENS, cfg))
    atol = testing.logits_atol(cfg, theirs, extra=4 * R)  # x A then B: r more on 4 linears
    np.testing.assert_allclose(ours, theirs, atol=atol, rtol=0)
    # The adapters matter at this tolerance: without them the logits are far off.
    plain = np.asarray(models.forward(params, TOKENS, cfg))
    assert np.abs(plain - theirs).max() > 100 * atol


def test_kaiming_init_has_peft_bounds(hf_base):
    _, params, cfg = hf_base
    lcfg = lora.LoraConfig(r=R, alpha=8, targets=["*.feed_forward.project", "*.query"])
    adapters = lora.init(jax.random.PRNGKey(0), cfg, lcfg)
    # torch's kaiming_uniform_(a=sqrt(5)) (what peft calls) on a large A gives the bound.
    for name, (a, b) in lora.adapter_layers(adapters).items():
        in_features = a.shape[1]
        witness = torch.empty(4096, in_features)
        torch.nn.init.kaiming_uniform_(witness, a=math.sqrt(5))
        torch_bound = float(witness.abs().max())
        assert abs(lora.kaiming_bound(in_features) - torch_bound) / torch_bound < 0.01
        assert float(jnp.abs(a).max()) <= lora.kaiming_bound(in_features)
        assert float(jnp.abs(a).max()) > 0.8 * lora.kaiming_bound(in_features), name
        assert not np.asarray(b).any()
    # peft's own A (default init) lies within the same bound.
    model = _peft_model(hf_base[0], target_modules=["c_fc"])
    for w in _weights(model).values():
        assert np.abs(w["a"]).max() <= lora.kaiming_bound(w["a"].shape[1]) + 1e-7


def test_gaussian_init_matches_peft_std(hf_base):
    path, _, cfg = hf_base
    lcfg = lora.LoraConfig(r=R, alpha=8, targets="all-linear", init="gaussian")
    ours = np.concatenate(
        [
            np.ravel(a)
            for a, _ in lora.adapter_layers(lora.init(jax.random.PRNGKey(0), cfg, lcfg)).values()
        ]
    )
    model = _peft_model(
        path, target_modules=["c_attn", "c_proj", "c_fc"], init_lora_weights="gaussian"
    )
    theirs = np.concatenate([np.ravel(w["a"]) for w in _weights(model).values()])
    assert abs(ours.std() - 1 / R) < 0.05 / R and abs(theirs.std() - 1 / R) < 0.05 / R


def test_targets_scale_and_config_errors():
    cfg = models.preset("gpt2", vocab_size=V, context_length=C, d_model=D, n_heads=4,
                        n_layers=N_LAYERS, d_ff=4 * D)  # fmt: skip
    default = lora.target_layers(cfg, lora.LoraConfig())
    assert list(default) == [
        f"blocks.{i}.attention.{p}" for i in range(N_LAYERS) for p in ("query", "value")
    ]
    weights = lora.LoraConfig(targets=["*.attention.query.weight", "*.value.weight"])
    assert lora.target_layers(cfg, weights) == default
    every = lora.target_layers(cfg, lora.LoraConfig(targets="all-linear"))
    assert len(every) == 6 * N_LAYERS and not any("head" in n for n in every)
    assert lora.LoraConfig(r=4, alpha=8).scale == 2.0
    assert lora.LoraConfig(r=4, alpha=8, rslora=True).scale == 4.0
    parsed = lora.LoraConfig.parse("r=16,alpha=32,targets=*.query|*.expand,dropout=0.1")
    assert (parsed.r, parsed.alpha, parsed.targets, parsed.dropout) == (
        16, 32.0, ("*.query", "*.expand"), 0.1
    )  # fmt: skip
    with pytest.raises(ConfigError, match="lora target"):
        lora.target_layers(cfg, lora.LoraConfig(targets="*.attention.qurey"))
    for bad in ("r=0", "alpha=-1", "dropout=1.0", "init=xavier", "rank=4", "r", "r=8,r=4"):
        with pytest.raises(ConfigError):
            lora.LoraConfig.parse(bad)


@pytest.fixture(scope="module")
def tiny():
    cfg = models.preset("gpt", vocab_size=V, context_length=C, d_model=D, n_heads=4,
                        n_layers=N_LAYERS, d_ff=2 * D)  # fmt: skip
    params = jax.jit(models.init, static_argnums=1)(jax.random.PRNGKey(0), cfg)  # one compile
    lcfg = lora.LoraConfig(r=R, alpha=8, targets="all-linear")
    adapters = lora.init(jax.random.PRNGKey(1), cfg, lcfg)
    k = iter(jax.random.split(jax.random.PRNGKey(2), 64))
    adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(k), x.shape), adapters)
    return cfg, params, lcfg, adapters


def test_zero_b_is_the_base_and_merge_equals_attach(tiny):
    cfg, params, lcfg, adapters = tiny
    fresh = lora.init(jax.random.PRNGKey(5), cfg, lcfg)
    base = models.forward(params, TOKENS, cfg)
    np.testing.assert_array_equal(
        models.forward(lora.attach(params, fresh, lcfg), TOKENS, cfg), base
    )
    attached = models.forward(lora.attach(params, adapters, lcfg), TOKENS, cfg)
    merged = lora.merge(params, adapters, lcfg)
    atol = testing.logits_atol(cfg, attached, extra=4 * R)
    np.testing.assert_allclose(models.forward(merged, TOKENS, cfg), attached, atol=atol, rtol=0)
    assert np.abs(np.asarray(attached - base)).max() > 1e-2
    back = lora.unmerge(merged, adapters, lcfg)
    # (W + s B A) - s B A: one rounding of the sum, and s B A (r = 4 terms) rounded apart in the
    # two programs: (1 + 2 r) u of entries below 1, 5e-7, on any CPU.
    for name, leaf in ptree.flatten(params).items():
        np.testing.assert_allclose(ptree.flatten(back)[name], leaf, atol=1e-6, rtol=0, err_msg=name)


def test_adapter_gradient_equals_merged_weight_gradient(tiny):
    """d loss / d(A, B) through the attached adapters equals jax.grad through W + s B A."""
    cfg, params, lcfg, adapters = tiny

    def via_attach(ad):
        return models.forward(lora.attach(params, ad, lcfg), TOKENS, cfg).std()

    def via_merge(ad):
        return models.forward(lora.merge(params, ad, lcfg), TOKENS, cfg).std()

    ours, witness = jax.grad(via_attach)(adapters), jax.grad(via_merge)(adapters)
    # Float32 rounding of either program (lmjax.testing.f32_rtol): the forward and the backward,
    # the std's two sums over the B C V logits; relative to the largest gradient entry.
    chain = 2 * testing.forward_chain(cfg, C, extra=4 * R) + 2 * TOKENS.size * V
    atol = testing.f32_rtol(chain) * max(float(np.abs(w).max()) for w in jax.tree.leaves(witness))
    for name, g in ptree.flatten(ours).items():
        np.testing.assert_allclose(g, ptree.flatten(witness)[name], atol=atol, rtol=0, err_msg=name)


def test_adapters_file_round_trip_and_bad_files(tiny, tmp_path):
    _, _, lcfg, adapters = tiny
    path = tmp_path / "adapters.safetensors"
    custom = lora.LoraConfig(r=R, alpha=3, targets="all-linear", rslora=True, dropout=0.05)
    lora.save_adapters(path, adapters, custom)
    back, back_cfg = lora.load_adapters(path, expected=adapters)
    assert back_cfg == custom
    for name, leaf in ptree.flatten(adapters).items():
        np.testing.assert_array_equal(ptree.flatten(back)[name], leaf)
    from lmjax.io import safetensors

    safetensors.save(adapters, tmp_path / "plain.safetensors")
    with pytest.raises(FileFormatError, match="lmjax-lora"):
        lora.load_adapters(tmp_path / "plain.safetensors")
    wrong = jax.tree.map(lambda x: jnp.zeros((*x.shape[:-1], x.shape[-1] + 1)), adapters)
    with pytest.raises(Exception, match="shape|mismatch"):
        lora.load_adapters(path, expected=wrong)
    with pytest.raises(ShapeError):
        lora.attach(tiny[1], wrong, lcfg)
    # A base of other dimensions: merge names the layer (it was a raw broadcasting TypeError).
    wider = models.preset("gpt", vocab_size=V, context_length=C, d_model=2 * D, n_heads=4,
                          n_layers=N_LAYERS, d_ff=2 * D)  # fmt: skip
    other = jax.eval_shape(models.init, jax.random.PRNGKey(0), wider)
    for fold in (lora.merge, lora.unmerge):
        with pytest.raises(ShapeError, match="blocks.attention.key"):
            fold(other, adapters, lcfg)


def _per_layer(layers) -> dict:
    """`{layer: (A, B)}` -> adapters under per-layer names, as they were stored before the blocks
    were stacked (`blocks.0.attention.query.lora_a [r, in]`)."""
    flat = {f"{layer}.lora_a": a for layer, (a, _) in layers.items()}
    return ptree.unflatten(flat | {f"{layer}.lora_b": b for layer, (_, b) in layers.items()})


def test_adapters_file_written_per_layer_loads_stacked(tiny, tmp_path):
    """A file of per-layer names (`blocks.{i}.….lora_a`, as adapters were saved before the
    blocks were stacked) loads into the stacked tree `init` makes: given N by `expected`, or kept
    per layer without it, which `attach` and `merge` stack themselves."""
    cfg, params, lcfg, adapters = tiny
    from lmjax.io import safetensors

    per_layer = _per_layer(lora.adapter_layers(adapters))
    old = tmp_path / "old.safetensors"
    safetensors.save(
        per_layer, old, metadata={"format": "lmjax-lora", "lora": json.dumps(lcfg.to_dict())}
    )
    assert "blocks.0.attention.query.lora_a" in safetensors.read_header(old)[0]
    back, back_cfg = lora.load_adapters(old, expected=jax.eval_shape(lambda: adapters))
    assert back_cfg == lcfg
    assert jax.tree.structure(back) == jax.tree.structure(adapters)
    for name, leaf in ptree.flatten(adapters).items():
        np.testing.assert_array_equal(ptree.flatten(back)[name], leaf, err_msg=name)
    as_named, _ = lora.load_adapters(old)  # N unknown: the file's names
    assert "blocks.1.attention.query.lora_a" in ptree.flatten(as_named)
    np.testing.assert_array_equal(
        models.forward(lora.attach(params, as_named, lcfg), TOKENS, cfg),
        models.forward(lora.attach(params, adapters, lcfg), TOKENS, cfg),
    )


def test_a_target_in_some_layers_is_gated_off_in_the_others(tiny, tmp_path):
    """`blocks.0.attention.value` and `blocks.1.attention.key` stack over both layers; the
    skipped layers add nothing (even with nonzero A and B there), get zero gradient, are not
    counted, saved or merged, and A starts as each layer's old per-layer draw."""
    cfg, params, _, _ = tiny
    lcfg = lora.LoraConfig(r=R, alpha=8, targets=["blocks.0.attention.value", "blocks.1.*.key"])
    fresh = lora.init(jax.random.PRNGKey(7), cfg, lcfg)
    assert set(ptree.flatten(fresh)) == {
        f"blocks.attention.{p}.lora_{w}" for p in ("key", "value") for w in "ab"
    }
    # Per layer, the values of the old per-layer init: fold_in(key, k), k in name order.
    chosen = ["blocks.0.attention.value", "blocks.1.attention.key"]
    assert list(lora.target_layers(cfg, lcfg)) == chosen
    for k, name in enumerate(chosen):
        bound = lora.kaiming_bound(D)
        old = jax.random.uniform(
            jax.random.fold_in(jax.random.PRNGKey(7), k), (R, D), jnp.float32, -bound, bound
        )
        np.testing.assert_array_equal(lora.adapter_layers(fresh, lcfg)[name][0], old)
    value_a = ptree.flatten(fresh)["blocks.attention.value.lora_a"]
    assert not np.asarray(value_a[1]).any()  # the skipped layer: A = 0
    assert lora.count(fresh, lcfg) == 2 * R * (D + D) < lora.count(fresh)

    k = iter(jax.random.split(jax.random.PRNGKey(8), 8))
    noisy = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(k), x.shape), fresh)
    noisy_flat = ptree.flatten(noisy)
    only = _per_layer(lora.adapter_layers(noisy, lcfg))  # the targeted layers alone
    logits = models.forward(lora.attach(params, noisy, lcfg), TOKENS, cfg)
    unrolled = cfg.replace(scan_layers=False)  # the gate's cond, scanned and not: same logits
    atol = testing.logits_atol(cfg, logits, extra=4 * R)
    np.testing.assert_allclose(
        models.forward(lora.attach(params, noisy, lcfg), TOKENS, unrolled),
        logits,
        atol=atol,
        rtol=0,
    )
    np.testing.assert_array_equal(
        models.forward(lora.attach(params, only, lcfg), TOKENS, cfg), logits
    )
    grads = ptree.flatten(
        jax.grad(lambda ad: models.forward(lora.attach(params, ad, lcfg), TOKENS, cfg).std())(noisy)
    )
    for name, skipped, used in (("value", 1, 0), ("key", 0, 1)):
        for w in "ab":
            g = grads[f"blocks.attention.{name}.lora_{w}"]
            assert not np.asarray(g[skipped]).any() and np.asarray(g[used]).any(), (name, w)

    merged = ptree.flatten(lora.merge(params, noisy, lcfg))
    base = ptree.flatten(params)
    for name, skipped in (("value", 1), ("key", 0)):
        w = f"blocks.attention.{name}.weight"
        np.testing.assert_array_equal(merged[w][skipped], base[w][skipped])
        assert not np.array_equal(merged[w][1 - skipped], base[w][1 - skipped])
    atol = testing.logits_atol(cfg, logits, extra=4 * R)
    np.testing.assert_allclose(
        models.forward(ptree.unflatten(merged), TOKENS, cfg), logits, atol=atol, rtol=0
    )

    path = tmp_path / "some.safetensors"
    lora.save_adapters(path, noisy, lcfg)
    from lmjax.io import safetensors

    assert set(safetensors.read_header(path)[0]) == {
        f"{layer}.lora_{w}" for layer in chosen for w in "ab"
    }
    back, _ = lora.load_adapters(path)  # N from the file's metadata
    assert ptree.flatten(back).keys() == noisy_flat.keys()
    for name, leaf in ptree.flatten(back).items():
        gate = lora.targeted(name.rpartition(".")[0], N_LAYERS, lcfg)
        for i, on in enumerate(gate):  # the skipped layers come back zero
            np.testing.assert_array_equal(leaf[i], noisy_flat[name][i] if on else 0.0)


def test_training_moves_only_adapters(tiny):
    """Adapters are the whole train state (optimizer state included); the base, passed as the
    step's frozen argument, is bit-identical afterwards; the loss falls; dropout on."""
    cfg, params, _, _ = tiny
    lcfg = lora.LoraConfig(r=R, alpha=8, dropout=0.1)
    before = jax.tree.map(np.array, params)
    tx = optax.adamw(1e-2)
    state = init_state(jax.random.PRNGKey(0), cfg, tx, lambda k: lora.init(k, params, lcfg))
    n_adapter = ptree.count(state.params)
    assert n_adapter == lora.count(lora.init(jax.random.PRNGKey(0), cfg, lcfg))
    opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in opt_leaves) == 2 * n_adapter  # Adam's mu and nu, adapters only
    step = make_train_step(cfg, tx, lambda s: 1e-2, loss=lora.objective(cfg, lcfg))
    inputs = jnp.asarray(TOKENS[None, :, :-1] % 8)
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray((inputs + 1) % 8)}
    losses = []
    for _ in range(15):
        state, metrics = step(state, batch, params)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.5, losses
    for name, leaf in ptree.flatten(params).items():
        np.testing.assert_array_equal(np.asarray(leaf), ptree.flatten(before)[name], err_msg=name)
    assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(params))  # not donated


def _hlo_dot_flops(text: str) -> int:
    """2 x (output elements) x (contracted size), summed over every dot of a compiled module."""
    import re

    assert " while(" not in text  # a loop body would count once per trip: keep the model small
    total, shapes = 0, {}
    for line in text.splitlines():
        if line and not line.startswith(" "):
            shapes = {}  # a new computation: instruction names are local to it
        defined = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]", line)
        if defined:
            shapes[defined[1]] = [int(n) for n in defined[2].split(",") if n]
        if " dot(" in line:
            lhs = shapes[re.search(r"dot\(%([\w.\-]+)", line)[1]]
            contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)[1]
            k = math.prod(lhs[int(i)] for i in contracted.split(",") if i)
            total += 2 * math.prod(shapes[defined[1]]) * k
    return total


@pytest.mark.parametrize(
    "preset, targets",
    [
        ("gpt", lora.DEFAULT_TARGETS),
        ("llama", ("blocks.0.attention.value", "blocks.1.attention.key", "*.feed_forward.up")),
    ],
)
def test_lora_flops_equal_the_compiled_steps_dot_flops(preset, targets):
    """MFU's FLOPs of a LoRA step equal the matmul FLOPs XLA kept in the compiled step (frozen
    weight gradients and the gradient into block 0's frozen input are dead code there)."""
    from lmjax.train.metrics import flops_per_token, lora_flops_per_token

    # Unrolled, so every layer's dots are in the module once (a scan's body would count once).
    cfg = models.preset(preset, vocab_size=V, context_length=C, d_model=D, n_heads=4,
                        n_layers=N_LAYERS, d_ff=2 * D, scan_layers=False)  # fmt: skip
    params = jax.eval_shape(models.init, jax.random.PRNGKey(0), cfg)
    lcfg = lora.LoraConfig(r=R, alpha=8, targets=targets)
    tx = optax.sgd(1e-2)
    state = jax.eval_shape(
        lambda: init_state(jax.random.PRNGKey(0), cfg, tx, lambda k: lora.init(k, params, lcfg))
    )
    step = make_train_step(cfg, tx, lambda s: 1e-2, loss=lora.objective(cfg, lcfg))
    batch = {"inputs": jax.ShapeDtypeStruct((1, 4, C), jnp.int32)}
    batch["targets"] = batch["inputs"]
    text = step.lower(state, batch, params).compile().as_text()
    per_token = _hlo_dot_flops(text) / (4 * C)
    ours = lora_flops_per_token(cfg, C, lora.adapter_shapes(state.params, lcfg))
    assert ours == per_token
    assert ours < 0.8 * flops_per_token(cfg, C)  # what MFU counted before


def test_dropout_acts_on_the_adapter_input_only_and_only_with_a_key(tiny):
    """In `models.project`: with B = 0 a dropout key changes nothing (the base projection sees the
    whole input); with B != 0 it changes y; without a key (what evaluation and sampling attach)
    y = x W^T + b + s (x A^T) B^T exactly. The objective attaches keys only when given one."""
    cfg, params, _, adapters = tiny
    layer = ptree.unstack(params)["blocks"]["0"]["attention"]["query"]  # layer 0's, as a scan step
    a, b = lora.adapter_layers(adapters)["blocks.0.attention.query"]
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, D))
    key = jax.random.PRNGKey(9)
    base = models.project(layer, x)
    zero_b = lora.Adapter(a, jnp.zeros_like(b), key, 2.0, 0.5)
    np.testing.assert_array_equal(models.project({**layer, "lora": zero_b}, x), base)
    dropped = models.project({**layer, "lora": lora.Adapter(a, b, key, 2.0, 0.5)}, x)
    plain = models.project({**layer, "lora": lora.Adapter(a, b, None, 2.0, 0.5)}, x)
    by_hand = base + 2.0 * np.einsum("btr,or->bto", np.einsum("bti,ri->btr", x, a), b)
    atol = testing.f32_rtol(D + R + 2) * float(np.abs(by_hand).max())  # x W^T, x A^T B^T, adds
    np.testing.assert_allclose(plain, by_hand, atol=atol, rtol=0)
    assert float(jnp.abs(dropped - plain).max()) > 1e-2
    drop = lora.LoraConfig(r=R, alpha=8, targets="all-linear", dropout=0.5)
    keys = lambda tree: [  # noqa: E731
        leaf.key for leaf in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, lora.Adapter))
        if isinstance(leaf, lora.Adapter)
    ]  # fmt: skip
    assert all(k is None for k in keys(lora.attach(params, adapters, drop)))
    assert all(k is not None for k in keys(lora.attach(params, adapters, drop, key)))
    assert lora.objective(cfg, drop).uses_key
