"""Sharded fine-tuning on 8 simulated CPU devices: LoRA, QLoRA and full with freezing (issue 34).

As in tests/test_parallel_mesh.py, one subprocess (this file run as a script) does all the
8-device work and prints a JSON report; the tests assert on it. It builds a tiny GPT base on a
character corpus and, for each kind of fine-tune:

- one step on one device and on the mesh data=2,fsdp=4, from the same state (the adapters' B
  drawn non-zero, so that A's gradient is not exactly zero) and the same batch, with the frozen
  base laid out by `lmjax.finetune.sharded_parts` (the CLI's own code path): compared quantity
  by quantity with test_parallel_mesh's derived bounds (`step_excess`), whose TAU is recomputed
  for this model's contraction path (below);
- `lmjax finetune` for 2 steps on one device and with `parallel.mesh=data=2,fsdp=4`: the losses,
  validation losses and the merged models within the trajectory bound test_parallel_mesh uses
  for `lmjax train` (the one-step parameter bound, times the steps, times the loss's slope).

The contraction path: test_parallel_mesh's (projections, attention, MLP, head; forward and
backward), plus each adapter's detour on an adapted projection, x A^T then (.) B^T, D + r terms
where the base projection has D: at most 2 (D + r) more per adapted projection per layer,
forward and backward. NF4 dequantization is elementwise (no sum), so it adds nothing; the
frozen and trained halves of a full fine-tune are the plain model's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from _background import Worker, on_host_devices
from test_parallel_mesh import (
    EPS,
    LR,
    TOKENS,
    U,
    _gamma,
    _save,
    assert_losses_follow,
    clipped_gradient,
    param_bounds,
    row_scale,
    step_excess,
    worker_report,
)

# ~70 s of CPU in one subprocess (start-up, 3 x 2 one-step compiles, 6 short fine-tunes;
# measured 70 s of user + system time, loaded 2-core machine): `make test`, not test-fast.
pytestmark = pytest.mark.slow

MESH = "data=2,fsdp=4"
D, T, F, LAYERS, R = 32, 16, 64, 2, 4
TARGETS = ["*.attention.query", "*.attention.value"]
FREEZE = "token_embedding.*,blocks.0.*"
KINDS = {"lora": [], "qlora": ["--qlora"], "full": ["--full", "--freeze", FREEZE]}
TEXT = "".join(
    f"line {i}: the quick brown fox jumps over the lazy dog {i % 9}\n" for i in range(80)
)
COMMON = """
data: {{corpus: {root}/corpus.txt, tokenizer: char}}
optimizer: {{name: adamw, lr: {lr}, eps: {eps}}}
schedule: {{warmup_steps: 0, decay: constant}}
train: {{steps: 2, batch_size: 16, seq_len: {t}, grad_accum: 2, eval_every: 2, eval_batches: 1}}
checkpoint: {{every: 2}}
logging: {{every: 1, progress: false, sample_tokens: 0, sample_prompt: l, plot: false,
          peak_flops: 1.0e+12}}
"""
LORA = """
finetune: {{base: {root}/base}}
lora: {{r: {r}, alpha: 8, targets: {targets}, dropout: 0.0}}
"""
FULL = """
finetune: {{base: {root}/base}}
"""


def _config(template: str, root: Path) -> str:
    values = {"root": root, "lr": LR, "eps": EPS, "t": T, "r": R, "targets": json.dumps(TARGETS)}
    return template.format(**values) + COMMON.format(**values)


def _worker(root: Path) -> dict:
    """Everything that needs 8 devices; returns plain numbers, names and lists."""
    import jax.numpy as jnp

    from lmjax import cli, finetune, lora, models, parallel
    from lmjax import params as ptree
    from lmjax.config import RunConfig
    from lmjax.data import prepared as D_
    from lmjax.finetune.full import full_objective
    from lmjax.train import loop, optim
    from lmjax.train.finetuned import partition
    from lmjax.train.metrics import MetricsLog
    from lmjax.train.runs import load_run, write_weights_run
    from lmjax.train.step import init_state, make_train_step

    assert jax.device_count() == 8, jax.devices()
    (root / "corpus.txt").write_text(TEXT)
    data_cfg = {"corpus": str(root / "corpus.txt"), "tokenizer": "char"}
    run_cfg = {"model": {"preset": "gpt", "vocab_size": None}, "data": data_cfg}
    prepared = loop.prepare_data(RunConfig.from_dict(run_cfg), progress=False)
    model = models.preset("gpt", vocab_size=prepared.vocab_size, context_length=T, d_model=D,
                          n_heads=4, n_layers=LAYERS, d_ff=F)  # fmt: skip
    base = models.init(jax.random.PRNGKey(0), model)
    write_weights_run(root / "base", base, model, prepared.tokenizer, "char")
    (root / "lora.yaml").write_text(_config(LORA, root))
    (root / "full.yaml").write_text(_config(FULL, root))
    out: dict = {"vocab": prepared.vocab_size, "frozen_specs": {}, "runs": {}, "merged": {}}
    rng = np.random.default_rng(0)

    for kind, flags in KINDS.items():
        path = root / ("full.yaml" if kind == "full" else "lora.yaml")
        full = kind == "full"
        cfg, spec, base_run = finetune.load_config(
            path, qlora=kind == "qlora" or None, full=full or None,
            freeze=FREEZE if full else None,
        )  # fmt: skip
        tx, lr = optim.from_config(cfg)
        t = cfg.train
        batch = D_.train_batch(
            D_.open_prepared(D_.prepare_section(cfg.data, False)).train,
            t.seed, 0, t.batch_size, t.seq_len, t.grad_accum,
        )  # fmt: skip
        # The step-0 state, shared: LoRA's adapters with B drawn (B = 0 would zero A's gradient).
        _, frozen = finetune.sharded_parts(cfg, spec, base_run.params)  # one device: as loaded
        if full:
            trained0 = partition(base_run.params, spec.freeze)[0]
            loss = full_objective(model, spec.freeze)
        else:
            adapters = lora.init(jax.random.PRNGKey(1), frozen, spec.lora)
            trained0 = ptree.map_with_names(
                lambda n, a: a if n.endswith("lora_a") else
                jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype), adapters,
            )  # fmt: skip
            loss = lora.objective(model, spec.lora)
        state0 = init_state(jax.random.PRNGKey(0), model, tx, lambda k, t=trained0: t)
        ref, ref_m = make_train_step(model, tx, lr, loss=loss)(
            jax.tree.map(jnp.copy, state0), batch, frozen
        )
        _save(root / f"{kind}_ref.npz", trained0, ref, ref_m)

        mesh_cfg = cfg.replace(parallel=_mesh_section(cfg))
        _, frozen_m = finetune.sharded_parts(mesh_cfg, spec, base_run.params)
        shape = parallel.parse_mesh_arg(MESH)
        mesh, shardings = loop._mesh_and_shardings(shape, model, tx, lambda k, t=trained0: t)
        state = jax.device_put(jax.tree.map(jnp.copy, state0), shardings)
        bsh = parallel.batch_sharding(mesh, 3, batch_dim=1)
        step = make_train_step(model, tx, lr, shardings, loss)
        new, m = step(state, {k: jax.device_put(v, bsh) for k, v in batch.items()}, frozen_m)
        _save(root / f"{kind}_mesh.npz", trained0, new, m)
        out["frozen_specs"][kind] = _specs(frozen_m)
        out.setdefault("trained_specs", {})[kind] = _specs(new.params)

        # M: the largest mean |per-row gradient| of the trained tree (test_parallel_mesh).
        rows = [batch[k].reshape(-1, batch[k].shape[-1]) for k in ("inputs", "targets")]
        row_grads = jax.vmap(
            jax.grad(lambda p, z, x, y, f=loss.fn: f(p, z, x[None], y[None], None)),
            (None, None, 0, 0),
        )
        out.setdefault("row_scale", {})[kind] = row_scale(row_grads, trained0, frozen, *rows)

        # lmjax finetune, on one device and on the mesh.
        # Sampling (a gather of the sharded model, decoded on one device) once: its compile costs.
        sample = ["logging.sample_tokens=2"] if kind == "qlora" else []
        for where, extra in (("one", []), ("mesh", [f"parallel.mesh={MESH}", *sample])):
            run = root / f"{kind}-{where}"
            argv = ["finetune", str(path), *flags, f"run.dir={run}", *extra]
            assert cli.main(argv) == 0, argv
            records = MetricsLog(run / "metrics.jsonl").read()
            out["runs"][f"{kind}-{where}"] = [
                [r["step"], r.get("loss"), r.get("val_loss")] for r in records
            ]
            merged = load_run(run / "merged").params
            np.savez(root / f"{kind}-{where}-merged.npz", **_flat(merged))
            if sample and where == "mesh":
                out["sample"] = (run / "samples.txt").read_text()
            saved = yaml.safe_load((run / "config.yaml").read_text())["parallel"]["mesh"]
            out.setdefault("config_mesh", {})[f"{kind}-{where}"] = saved
            if kind != "full" and where == "one":  # the merge's bound needs their sizes
                adapters = lora.load_adapters(run / "adapters.safetensors")[0]
                out.setdefault("adapter_max", {})[kind] = [
                    max(float(jnp.max(jnp.abs(x))) for n, x in ptree.flatten(adapters).items()
                        if n.endswith(part)) for part in ("lora_a", "lora_b")
                ]  # fmt: skip
    return out


def _mesh_section(cfg):
    import dataclasses

    from lmjax import parallel

    return dataclasses.replace(cfg.parallel, mesh=parallel.parse_mesh_arg(MESH))


def _flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def _specs(tree) -> dict[str, list]:
    """Each leaf's PartitionSpec (trailing Nones dropped), keyed by its path."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, leaf in flat:
        spec = [list(e) if isinstance(e, tuple) else e for e in leaf.sharding.spec]
        while spec and spec[-1] is None:
            spec.pop()
        out[jax.tree_util.keystr(path)] = spec
    return out


WORKER = Worker("finetune-mesh", on_host_devices(__file__))


def start_in_background(names: set[str]) -> None:
    """Called by tests/conftest.py at collection: the worker runs beside the suite."""
    WORKER.start()


@pytest.fixture(scope="module")
def report():
    return worker_report(WORKER)


def tau(vocab: int, kind: str) -> float:
    """TAU of test_parallel_mesh for this model: its path plus the adapters' detours."""
    path = 2 * (LAYERS * (2 * D + 2 * T + D + F) + D + vocab)
    if kind != "full":
        path += 2 * LAYERS * len(TARGETS) * (D + R)
    return 2 * (_gamma(TOKENS) + _gamma(path))


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_sharded_fine_tune_step_matches_one_device(report, kind):
    """Loss, gradient norm, Adam's moments and the trained parameters after one step on
    data=2,fsdp=4, each within its derived bound of the one-device step; integers equal."""
    ref, got = report["steps"][f"{kind}_ref"], report["steps"][f"{kind}_mesh"]
    excess = step_excess(ref, got, report["row_scale"][kind], "adam", tau(report["vocab"], kind))
    assert max(excess.values()) <= 1, excess
    assert excess["gradient"] > 0 or kind == "full"  # a real comparison, not of zeros
    for k, v in ref.items():
        if not np.issubdtype(v.dtype, np.floating):
            np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_the_bound_catches_a_doubled_gradient(report):
    """The same comparison against a step whose gradient is twice the mesh step's (what an
    all-reduce summing where it should average over 2 shards gives): far out of bounds."""
    ref, got = report["steps"]["lora_ref"], dict(report["steps"]["lora_mesh"])
    got["metric.grad_norm"] = 2 * got["metric.grad_norm"]
    excess = step_excess(
        ref, got, report["row_scale"]["lora"], "adam", tau(report["vocab"], "lora")
    )
    assert excess["grad_norm"] > 10, excess


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_frozen_base_is_sharded_over_fsdp(report, kind):
    """Float weights by the rules (d_model over fsdp); NF4 codes and block scales along their
    flat axis over fsdp, the double-quantization scales replicated. LoRA's adapters are
    replicated; a full fine-tune's trained leaves follow the rules."""
    frozen, trained = report["frozen_specs"][kind], report["trained_specs"][kind]
    query = "['blocks']['attention']['query']['weight']"  # stacked: [layers, heads, embed]
    assert frozen["['token_embedding']['weight']"] == [None, "fsdp"], frozen
    if kind == "qlora":  # each layer's flat axis split, the layer axis whole
        assert frozen[query + ".packed"] == [None, "fsdp"] == frozen[query + ".qabsmax"]
        assert frozen[query + ".absmax2"] == [] and frozen[query + ".offset"] == []
    else:
        assert frozen[query] == [None, None, "fsdp"], frozen
    if kind == "full":  # blocks.0.* froze layer 0 of it: it trains whole, sharded by the rules
        assert trained[query] == [None, None, "fsdp"]
        assert "['token_embedding']['weight']" not in trained
    else:
        assert trained and all(s == [] for s in trained.values()), trained


@pytest.mark.parametrize("kind", list(KINDS))
def test_sharded_lmjax_finetune_has_the_one_device_losses(report, kind):
    """Train and validation losses of `lmjax finetune` on the mesh against one device, and the
    merged models, within test_parallel_mesh's trajectory bound: TAU L, plus k steps of the
    one-step parameter bound Θ times the loss's slope (first step's ‖g‖_1)."""
    one, mesh = report["runs"][f"{kind}-one"], report["runs"][f"{kind}-mesh"]
    assert report["config_mesh"][f"{kind}-mesh"] == {"data": 2, "fsdp": 4}
    assert report["config_mesh"][f"{kind}-one"] is None
    assert [r[0] for r in one] == [r[0] for r in mesh] and len(one) >= 3, (one, mesh)
    if kind == "qlora":  # sampled from the gathered NF4 base and adapters
        assert report["sample"].startswith("===== step 2 =====\nl"), report["sample"]
    ref, got = report["steps"][f"{kind}_ref"], report["steps"][f"{kind}_mesh"]
    g_ref, g_got = clipped_gradient(ref, "adam"), clipped_gradient(got, "adam")
    theta = max(float(np.max(b)) for b in param_bounds(ref, got, g_ref, g_got, "adam").values())
    assert_losses_follow(one, mesh, ref, theta, tau(report["vocab"], kind))
    # The merged models. Full: each parameter moved by at most 2 Θ (two updates). LoRA:
    # W + s B A with A and B each within 2 Θ, so |Δ(B A)_ij| <= Σ_k |ΔB_ik| |A_kj| +
    # |B_ik| |ΔA_kj| + |ΔB_ik| |ΔA_kj| <= r 2Θ (max|A| + max|B| + 2Θ), times s = alpha / r;
    # plus the merge's roundings (the product's r terms and the add): (r + 2) u |W'|.
    one_m, mesh_m = report["steps"][f"{kind}-one-merged"], report["steps"][f"{kind}-mesh-merged"]
    assert one_m.keys() == mesh_m.keys() and one_m
    for k, v in one_m.items():
        if kind == "full":
            bound = 2 * theta + 2 * U * np.abs(v)
        else:
            max_a, max_b = report["adapter_max"][kind]
            bound = 2 * R * 2 * theta * (max_a + max_b + 2 * theta) + (R + 2) * U * np.abs(v)
        assert np.all(np.abs(mesh_m[k] - v) <= bound), (k, float(np.max(np.abs(mesh_m[k] - v))))


if __name__ == "__main__":
    jax.config.update("jax_numpy_rank_promotion", "raise")  # as tests/conftest.py
    jax.config.update("jax_default_matmul_precision", "highest")
    print(json.dumps(_worker(Path(sys.argv[1]))))
