"""Sharded training on 8 simulated CPU devices (SPEC section 9).

XLA_FLAGS must be set before jax starts, and the suite's jax is already running, so one
subprocess (this file run as a script) does all the 8-device work at once, paying start-up and
compilation once, and prints a JSON report; the tests below assert on it.

Tolerances, derived rather than read off a machine. XLA's CPU code generator picks its vector
instructions from the host (AVX-512 or not), so the order of every float32 sum, and its
rounding, differs between machines as well as between a mesh and one device. One step on each
mesh is compared with the single-device step by `step_excess`, quantity by quantity, each as
measured difference / bound (u = 2^-24, gamma_n = n u / (1 - n u)):

- Gradient. Two float32 evaluations of the same sum of n terms, in any orders, differ by at most
  2 gamma_{n-1} sum |x_i| (Higham's worst case; an inner product likewise with gamma_n). Each
  gradient entry sums TOKENS = 256 per-token terms, each the product of quantities built by the
  contractions along the network's longest path (PATH: the projections, attention, MLP and
  head, forward and backward), whose errors add to first order; the nonlinearities between
  them are well conditioned at this scale. So |Δg_i| <= TAU M with TAU = 2 (gamma_TOKENS +
  gamma_PATH) ~ 2200 u, and M the largest mean |per-row gradient| (measured in the same run:
  sum |x_i| >= |sum x_i|, so M counts what cancels in the batch mean).
- The clipped gradient ĝ = g / ‖g‖ (‖g‖ ~ 4.7 > clip 1), read from the state (Adam's
  mu = (1 - b1) ĝ after one step, SGD's trace = ĝ): |Δĝ_i| <= (TAU M + |ĝ_i| Δ_norm) / ‖g‖
  plus three roundings; Δ_norm = sqrt(P) TAU M + gamma_P ‖g‖ (triangle inequality, then the
  sum of P squares). Adam's nu = (1 - b2) ĝ^2 follows.
- Loss: a mean of TOKENS positive terms from the same contractions: TAU L.
- Parameters. Adam's first update lr ĝ / (|ĝ| + eps) has slope eps / (|ĝ| + eps)^2 <= 1 / eps,
  so given the two gradients the parameters differ by at most lr times that slope (largest
  where |ĝ| is smallest between them) times |Δĝ_i|, plus the update's 8 roundings and θ'
  rounded on each side (2 u |θ'|). At the default eps = 1e-8 the slope reaches lr / eps = 1e6:
  the attention key biases have an exactly zero gradient (softmax is invariant to a score
  shift shared by all keys), computed as rounding noise ~1e-10 of either sign, which Adam
  turns into updates of up to ±lr. The test optimizer uses eps = 1e-4 (slope <= 100).

These worst-case bounds sit 400-800x above the gradient differences seen (about 10 u of the
largest entry on AVX2, SSE4.2 and AVX-512 CPUs), and the parameter bound is reached only by a
one-ulp difference; they still catch a sharding bug by far: `test_the_bounds_catch_a_sharding_bug`
runs the same comparison on a step whose gradients are doubled (the gradient norm is 215x its
bound) and on one that dropped a micro-batch (loss 26x, gradient 1,200x), and any reduction
done in bfloat16 (2^-9 relative) would exceed TAU by 15x. `make test-portable` runs this file
as a CPU without AVX-512 would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _background import Worker, on_host_devices

# ~75 s of CPU in one subprocess (start-up, 4 meshes, 3 short runs; measured 75 s, loaded
# 2-core machine): `make test`, not test-fast.
pytestmark = pytest.mark.slow

MESHES = [(8, 1, 1), (2, 4, 1), (1, 4, 2), (1, 1, 8)]
LR, EPS = 1e-2, 1e-4
# d_ff 36: model=8 does not divide it (the rule replicates that dim); gpt: biases and learned
# positions, so 1-D leaves and the context axis are covered too.
# No samples: no test here reads them (sampling on a mesh is test_finetune_mesh's and
# test_multiprocess's), and each run would compile a sampler for them.
CONFIG = f"""
model: {{preset: gpt, vocab_size: 64, context_length: 16, d_model: 32, n_heads: 4,
        n_layers: 2, d_ff: 36}}
optimizer: {{name: adamw, lr: {LR}, eps: {EPS}}}
schedule: {{warmup_steps: 0, decay: constant}}
train: {{steps: 4, batch_size: 16, seq_len: 16, grad_accum: 2, eval_every: 2, eval_batches: 1}}
checkpoint: {{every: 2}}
logging: {{every: 1, progress: false, sample_tokens: 0, sample_prompt: a, plot: false,
          peak_flops: 1.0e+12}}
"""
TEXT = "".join(
    f"line {i}: the quick brown fox jumps over the lazy dog {i % 9}\n" for i in range(80)
)


def _worker(workdir: Path) -> dict:
    """Everything that needs 8 devices; returns plain numbers, names and lists."""
    import dataclasses

    import jax.numpy as jnp

    from lmjax import cli, data, parallel, train
    from lmjax.config import load_run_config
    from lmjax.train import optim
    from lmjax.train.checkpoint import Checkpoints
    from lmjax.train.step import Loss, init_state, loss_fn, make_train_step, model_loss

    assert jax.device_count() == 8, jax.devices()
    (workdir / "cfg.yaml").write_text(CONFIG)
    cfg = load_run_config(workdir / "cfg.yaml")
    model = cfg.model_config()
    tx, lr = optim.from_config(cfg)
    state0 = init_state(jax.random.PRNGKey(0), model, tx)
    batch = data.train_batch(
        np.arange(4000) % 64, 0, 0, cfg.train.batch_size, 16, cfg.train.grad_accum
    )
    ref, ref_m = make_train_step(model, tx, lr)(jax.tree.map(jnp.copy, state0), batch)
    out: dict = {"meshes": {}}
    _save(workdir / "ref.npz", state0.params, ref, ref_m)

    def specs_of(tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(p): list(map(_entry, x.sharding.spec)) for p, x in flat}

    def on_mesh(shape, step_batch, loss=None):
        mesh = parallel.make_mesh(dict(zip(parallel.AXES, shape, strict=True)))
        specs = parallel.state_specs(state0, model, parallel.mesh_shape(mesh))
        shardings = parallel.shardings(specs, mesh)
        state = jax.device_put(jax.tree.map(jnp.copy, state0), shardings)
        step = make_train_step(model, tx, lr, shardings, loss)
        bsh = parallel.batch_sharding(mesh, 3, batch_dim=1)
        sharded_batch = {k: jax.device_put(v, bsh) for k, v in step_batch.items()}
        compiled = step.lower(state, sharded_batch).compile()
        new, m = compiled(state, sharded_batch)  # the same executable: compiled once
        return state, new, m, compiled.output_shardings[0]

    for shape in MESHES:
        state, new, m, out_state_sh = on_mesh(shape, batch)
        _save(workdir / f"{shape}.npz", state0.params, new, m)
        out["meshes"][str(shape)] = {
            "specs": specs_of(new),
            "compiled_param_bytes": _shard_bytes(new.params, out_state_sh.params),
            "compiled_opt_bytes": _shard_bytes(new.opt_state, out_state_sh.opt_state),
            "donated": all(x.is_deleted() for x in jax.tree.leaves(state.params)),
        }
        if shape == (2, 4, 1):
            saved = new
    # Two sharding bugs on (2, 4, 1), which the tolerances must catch: every gradient twice
    # what it should be (an all-reduce summing where it should average over 2 shards), the
    # loss itself right; and the second micro-batch dropped from the accumulation.
    plain = model_loss(model)
    doubled = Loss(lambda *a, **k: _double_gradient(plain.fn(*a, **k)), plain.uses_key)
    mutants = {"gradient_x2": (batch, doubled), "micro_batch_dropped": (_first(batch), None)}
    for name, (step_batch, loss) in mutants.items():
        _, new, m, _ = on_mesh((2, 4, 1), step_batch, loss)
        _save(workdir / f"{name}.npz", state0.params, new, m)
    out["ref_loss"], out["ref_grad_norm"] = float(ref_m["loss"]), float(ref_m["grad_norm"])

    # SGD (momentum trace = the clipped gradient, no 1/sqrt(v)): the gradients themselves,
    # on the mesh with every axis kind (fsdp and model) against one device.
    sgd = cfg.replace(optimizer=dataclasses.replace(cfg.optimizer, name="sgd"))
    sgd_tx, sgd_lr = optim.from_config(sgd)
    sgd0 = init_state(jax.random.PRNGKey(0), model, sgd_tx)
    ref, ref_m = make_train_step(model, sgd_tx, sgd_lr)(jax.tree.map(jnp.copy, sgd0), batch)
    _save(workdir / "sgd_ref.npz", sgd0.params, ref, ref_m)
    mesh = parallel.make_mesh({"fsdp": 4, "model": 2})
    shardings = parallel.shardings(
        parallel.state_specs(sgd0, model, parallel.mesh_shape(mesh)), mesh
    )
    bsh = parallel.batch_sharding(mesh, 3, batch_dim=1)
    new, m = make_train_step(model, sgd_tx, sgd_lr, shardings)(
        jax.device_put(jax.tree.map(jnp.copy, sgd0), shardings),
        {k: jax.device_put(v, bsh) for k, v in batch.items()},
    )
    _save(workdir / "sgd_(1, 4, 2).npz", sgd0.params, new, m)

    # The magnitude the gradient's float32 sums work at: the largest mean |per-row gradient|
    # (sum_r |g_r| / R >= |sum_r g_r| / R, so it counts what cancels in the batch mean).
    rows_BT = [batch[k].reshape(-1, batch[k].shape[-1]) for k in ("inputs", "targets")]
    row_grads = jax.vmap(
        jax.grad(lambda p, x_T, y_T: loss_fn(p, x_T[None], y_T[None], model)), (None, 0, 0)
    )
    out["row_scale"] = row_scale(row_grads, state0.params, *rows_BT)

    # A checkpoint saved on (2, 4, 1) restores onto (1, 4, 2) and onto one device.
    ckpt = Checkpoints(workdir / "ckpt")
    ckpt.save(saved, {"note": "mesh test"})
    mesh = parallel.make_mesh({"fsdp": 4, "model": 2})
    target = parallel.shardings(
        parallel.state_specs(state0, model, parallel.mesh_shape(mesh)), mesh
    )
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state0, target
    )
    restored = ckpt.restore(abstract)
    single = ckpt.restore(jax.eval_shape(lambda: state0))
    out["restore"] = {
        "equal_to_saved": all(  # on the host: jnp.array_equal compiled 2 programs per leaf
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True)
        ),
        "single_equal": all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(saved), strict=True)
        ),
        "specs_match_target": all(
            a.sharding.spec == s.spec and a.sharding.mesh.shape == s.mesh.shape
            for a, s in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True)
        ),
        "single_devices": sorted({len(a.sharding.device_set) for a in jax.tree.leaves(single)}),
    }

    # Which batch rows each group of devices (a simulated host) holds.
    mesh = parallel.make_mesh({"data": 2, "fsdp": 4})
    bsh = parallel.batch_sharding(mesh, 3, batch_dim=1)
    shape3 = (2, 8, 16)
    devs = list(mesh.devices.flat)
    out["host_rows"] = {
        str(n): [parallel.multihost.batch_rows(bsh, shape3, devs[i::n]) for i in range(n)]
        for n in (2, 4)
    }
    tokens = np.arange(5000) % 61
    whole = data.train_batch(tokens, 3, 7, 16, 16, 2)
    assembled = parallel.host_batch(
        lambda rows: data.train_batch(tokens, 3, 7, 16, 16, 2, rows), shape3, bsh
    )
    out["host_batch_equal"] = all(
        np.array_equal(np.asarray(assembled[k]), whole[k]) for k in ("inputs", "targets")
    )
    out["host_batch_spec"] = list(map(_entry, assembled["inputs"].sharding.spec))

    # lmjax train with and without a parallel section: the same losses.
    (workdir / "corpus.txt").write_text(TEXT)
    runs, meshes, make_mesh = {}, [], parallel.make_mesh
    eval_inputs, make_eval_step = [], train.loop.make_eval_step

    def recording_eval_step(model, mesh=None):  # records how each run lays out its eval batches
        step = make_eval_step(model, mesh)

        def run(params, inputs, targets):
            spec = inputs.sharding.spec if isinstance(inputs, jax.Array) else "host"
            eval_inputs.append(list(map(_entry, spec)) if spec != "host" else spec)
            return step(params, inputs, targets)

        return run

    train.loop.make_eval_step = recording_eval_step
    parallel.make_mesh = lambda shape, devices=None: (
        meshes.append(dict(shape)) or make_mesh(shape, devices)
    )  # records the meshes the runs build (lmjax.train.loop calls parallel.make_mesh)
    for name, extra in (
        ("plain", ""),
        ("sharded", "parallel: {mesh: {data: 2, fsdp: 2, model: 2}}"),
    ):
        text = CONFIG.replace("vocab_size: 64", "vocab_size: null") + extra
        text += f"\ndata: {{corpus: {workdir / 'corpus.txt'}, tokenizer: char}}\n"
        text += f"run: {{dir: {workdir / name}}}\n"
        path = str(workdir / f"{name}.yaml")
        (workdir / f"{name}.yaml").write_text(text)
        if name == "plain":
            assert cli.main(["train", path]) == 0
        else:  # 2 steps on (2, 2, 2), then resumed onto (1, 8, 1) for steps 3 and 4
            assert cli.main(["train", path, "train.steps=2"]) == 0
            assert cli.main(["train", path, "--resume", "parallel.mesh=fsdp=8"]) == 0
        records = train.metrics.MetricsLog(workdir / name / "metrics.jsonl").read()
        runs[name] = [[r["step"], r.get("loss"), r.get("val_loss")] for r in records]
        out.setdefault("eval_inputs", {})[name] = eval_inputs[:]
        eval_inputs.clear()
    out["runs"], out["run_meshes"] = runs, meshes
    return out


def row_scale(row_grads, *args) -> float:
    """M: the largest mean |per-row gradient| over the leaves of `row_grads(*args)` (a vmapped
    gradient, rows first), computed as one compiled program (run eagerly, its ~170 operations
    were each compiled on their own)."""

    @jax.jit
    def per_leaf(*args):
        import jax.numpy as jnp

        return [jnp.max(jnp.mean(jnp.abs(g), 0)) for g in jax.tree.leaves(row_grads(*args))]

    return max(float(m) for m in per_leaf(*args))


def _save(path: Path, params0, state, metrics) -> None:
    """A step's outcome as flat arrays: the state's leaves by key path, the initial parameters
    under "init" + path, and the metrics under "metric." + name."""
    arrays = {"init" + k: v for k, v in _flat(params0).items()} | _flat(state)
    arrays |= {f"metric.{k}": np.asarray(v) for k, v in metrics.items()}
    np.savez(path, **arrays)


def _flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


@jax.custom_vjp
def _double_gradient(x):
    """x, with twice its cotangent: a loss whose value is right and whose gradient is 2x."""
    return x


_double_gradient.defvjp(lambda x: (x, None), lambda _, g: (2 * g,))


def _first(batch: dict) -> dict:
    """The batch with only its first micro-batch: a step that dropped the second."""
    return {k: v[:1] for k, v in batch.items()}


def _entry(e):
    return list(e) if isinstance(e, tuple) else e


def _shard_bytes(tree, shardings) -> int:
    return sum(
        int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
    )


WORKER = Worker("mesh", on_host_devices(__file__))


def start_in_background(names: set[str]) -> None:
    """Called by tests/conftest.py at collection with this module's selected tests (every one
    reads the report): the ~75 s worker runs beside the suite."""
    WORKER.start()


def worker_report(worker: Worker) -> dict:
    """A mesh worker's last stdout line (JSON) with its saved steps as `steps[name]`."""
    done = worker.result()
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # float64 (exact) copies, so that computing a bound rounds far below the bound itself.
    out["steps"] = {p.stem: _float64(np.load(p)) for p in done.workdir.glob("*.npz")}
    return out


@pytest.fixture(scope="module")
def report():
    return worker_report(WORKER)


def _float64(arrays) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in arrays.items()}


# The bounds (module docstring). The model and batch of CONFIG:
U = 2.0**-24  # float32 unit roundoff
B1, B2, CLIP, WD = 0.9, 0.95, 1.0, 0.1  # OptimizerConfig's defaults, which CONFIG keeps
TOKENS = 16 * 16  # batch_size x seq_len: the per-token terms summed into each gradient entry
D, T, F, V, LAYERS = 32, 16, 36, 64, 2
# Contraction lengths along the longest path through the network, forward and backward: per
# block q/k/v and output projections (D, D), scores and their weighting (T, T), the MLP (D, F);
# then the head (D forward, V backward).
PATH = 2 * (LAYERS * (2 * D + 2 * T + D + F) + D + V)


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): a float32 sum of n terms, in any order, is within
    gamma_{n-1} sum |x_i| of the exact sum (Accuracy and Stability of Numerical Algorithms,
    2nd ed., eq. 4.4); an inner product of length n within gamma_n sum |x_i y_i| (eq. 3.5)."""
    return n * U / (1 - n * U)


# Two float32 evaluations of the gradient differ by at most twice one's error: the token sum
# plus the contractions along the path, relative to the magnitudes they sum.
TAU = 2 * (_gamma(TOKENS) + _gamma(PATH))


def _moments(step: dict, name: str) -> dict[str, np.ndarray]:
    """The optimizer-state leaves `name` (mu, nu, trace), keyed by parameter path."""
    tag = f".opt_state[1][0].{name}"
    return {k[len(tag) :]: v for k, v in step.items() if k.startswith(tag)}


def clipped_gradient(step: dict, optimizer: str) -> dict[str, np.ndarray]:
    """ĝ from the first step's optimizer state: Adam's mu = (1 - b1) ĝ, SGD's trace = ĝ."""
    if optimizer == "adam":
        return {k: v / (1 - B1) for k, v in _moments(step, "mu").items()}
    return _moments(step, "trace")


def _param_paths(step: dict) -> list[str]:
    return sorted(k[len(".params") :] for k in step if k.startswith(".params"))


def step_excess(
    ref: dict, got: dict, row_scale: float, optimizer: str, tau: float = TAU
) -> dict[str, float]:
    """measured difference / derived bound of each quantity of one step against the
    single-device step (module docstring); above 1 is a violation. `row_scale`: M; `tau`: TAU
    of another model's contraction path (tests/test_finetune_mesh.py)."""
    norm = float(ref["metric.grad_norm"])
    n_params = sum(ref[".params" + k].size for k in _param_paths(ref))
    # |‖g'‖ - ‖g‖| <= ‖g' - g‖_2 + rounding of the sum of squares (P non-negative terms).
    norm_bound = np.sqrt(n_params) * tau * row_scale + _gamma(n_params) * norm
    scale = CLIP / norm  # the clipping factor; norm > CLIP here
    g_ref, g_got = clipped_gradient(ref, optimizer), clipped_gradient(got, optimizer)
    out = {"grad_norm": abs(float(got["metric.grad_norm"]) - norm) / norm_bound}
    # ĝ = g / ‖g‖: |Δĝ| <= |Δg| / ‖g‖ + |ĝ| |Δ‖g‖| / ‖g‖, plus 3 roundings (scale, (1-b1), /).
    g_bound = {
        k: scale * tau * row_scale + np.abs(g) * (norm_bound / norm + 3 * U)
        for k, g in g_ref.items()
    }
    out["gradient"] = max(
        float(np.max(np.abs(g_got[k] - g) / g_bound[k])) for k, g in g_ref.items()
    )
    if optimizer == "adam":
        # The losses: means of TOKENS positive terms, each from the same contractions.
        loss = float(ref["metric.loss"])
        out["loss"] = abs(float(got["metric.loss"]) - loss) / (tau * loss)
        nu_ref, nu_got = _moments(ref, "nu"), _moments(got, "nu")
        out["adam_nu"] = max(
            float(np.max(np.abs(nu_got[k] - v) / (
                (1 - B2) * (2 * np.abs(g_ref[k]) + g_bound[k]) * g_bound[k] + 2 * U * v
            )))
            for k, v in nu_ref.items()
        )  # fmt: skip
    out["params"] = max(
        float(np.max(np.abs(got[".params" + k] - ref[".params" + k]) / bound))
        for k, bound in param_bounds(ref, got, g_ref, g_got, optimizer).items()
    )
    return out


def param_bounds(ref: dict, got: dict, g_ref: dict, g_got: dict, optimizer: str) -> dict:
    """Per parameter entry, the bound on |θ'_mesh - θ'_one| given the two clipped gradients."""
    bounds = {}
    for k in _param_paths(ref):
        g, g2 = g_ref[k], g_got[k]
        theta0 = ref["init" + k]
        new = np.maximum(np.abs(ref[".params" + k]), np.abs(got[".params" + k]))
        if optimizer == "adam":
            # u(ĝ) = ĝ / (|ĝ| + eps) has slope eps / (|ĝ| + eps)^2 <= 1 / eps: between the two
            # gradients it is largest where |ĝ| is smallest (0 if they straddle zero).
            low = np.where(np.sign(g) == np.sign(g2), np.minimum(np.abs(g), np.abs(g2)), 0.0)
            slope = EPS / (low + EPS) ** 2
            rounding = 8 * U * LR * (1 + WD * np.abs(theta0))  # the update's 8 operations
        else:  # θ - lr ĝ
            slope, rounding = 1.0, U * LR * np.abs(g)
        # and θ' rounded once on each side: at most u |θ'| each
        bounds[k] = LR * slope * np.abs(g2 - g) + rounding + 2 * U * np.abs(new)
    return bounds


def assert_losses_follow(one: list, mesh: list, ref: dict, theta: float, tau: float) -> None:
    """Each logged train and validation loss of `mesh` (rows `[step, loss, val_loss]`) within
    its bound of `one`'s: tau L (its own sums), plus what k updates moved the parameters apart
    times the loss's slope, |ΔL| <= Σ|∂L/∂θ_i| |Δθ_i| <= ‖g‖_1 k Θ to first order; Θ is the
    largest one-step parameter bound, ‖g‖_1 the first step's (`ref`: its recorded step)."""
    g_ref = clipped_gradient(ref, "adam")
    g1 = sum(float(np.sum(np.abs(g))) for g in g_ref.values()) * float(ref["metric.grad_norm"])
    for a, b in zip(one, mesh, strict=True):
        step, (x_loss, x_val), (y_loss, y_val) = a[0], a[1:], b[1:]
        # The train loss of step k is before its update (k - 1 updates), its val loss after.
        for x, y, updates in ((x_loss, y_loss, step - 1), (x_val, y_val, step)):
            assert (x is None) == (y is None)
            if x is not None:
                assert abs(y - x) <= tau * abs(x) + updates * theta * g1, (a, b, theta, g1)


@pytest.mark.parametrize("shape", MESHES)
def test_one_step_matches_single_device(report, shape):
    """Loss, gradient norm, Adam's moments and the parameters of one AdamW step on the mesh,
    each within its derived bound of the single-device step; integers (step, Adam's count,
    key) equal."""
    ref, got = report["steps"]["ref"], report["steps"][str(shape)]
    excess = step_excess(ref, got, report["row_scale"], "adam")
    assert max(excess.values()) <= 1, excess
    for k, v in ref.items():
        if not np.issubdtype(v.dtype, np.floating):
            np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert report["meshes"][str(shape)]["donated"]  # the input buffers were given to the step


@pytest.mark.parametrize(
    "mutant, caught_by",
    [
        ("gradient_x2", {"grad_norm"}),
        ("micro_batch_dropped", {"loss", "grad_norm", "gradient", "adam_nu"}),
    ],
)
def test_the_bounds_catch_a_sharding_bug(report, mutant, caught_by):
    """The same comparison of a step with a known bug on (2, 4, 1) fails, and by far: every
    gradient doubled (clipping then hides it from the state; the gradient norm shows it), and
    the second micro-batch dropped."""
    ref, got = report["steps"]["ref"], report["steps"][mutant]
    excess = step_excess(ref, got, report["row_scale"], "adam")
    assert {k for k, v in excess.items() if v > 10} == caught_by, excess


def test_sgd_step_matches_single_device_to_float32_rounding(report):
    """SGD on (1, 4, 2): the momentum trace (the clipped gradient itself, not normalized by
    Adam) and the parameters θ - lr ĝ within the same bounds."""
    ref, got = report["steps"]["sgd_ref"], report["steps"]["sgd_(1, 4, 2)"]
    excess = step_excess(ref, got, report["row_scale"], "sgd")
    assert max(excess.values()) <= 1, excess


# Hand-written from the rules in lmjax/parallel/rules.py's docstring (an independent statement
# of them): embed -> fsdp, heads/mlp -> model, vocab/context replicated, size-1 axes dropped,
# an indivisible dim (d_ff 36 on model=8) replicated.
EXPECTED = {
    (8, 1, 1): {"query.weight": [None, None], "expand.weight": [None, None], "tok": [None, None]},
    (2, 4, 1): {"query.weight": [None, "fsdp"], "expand.weight": [None, "fsdp"],
                "tok": [None, "fsdp"], "project.bias": ["fsdp"], "query.bias": [None]},
    (1, 4, 2): {"query.weight": ["model", "fsdp"], "expand.weight": ["model", "fsdp"],
                "project.weight": ["fsdp", "model"], "output.weight": ["fsdp", "model"],
                "tok": [None, "fsdp"], "pos": [None, "fsdp"], "query.bias": ["model"]},
    (1, 1, 8): {"query.weight": ["model", None], "expand.weight": [None, None],
                "project.weight": [None, None], "expand.bias": [None], "tok": [None, None]},
}  # fmt: skip
NAMES = {  # the blocks stacked: their leaves lead with the layer axis, never split
    "query.weight": "['blocks']['attention']['query']['weight']",
    "query.bias": "['blocks']['attention']['query']['bias']",
    "output.weight": "['blocks']['attention']['output']['weight']",
    "expand.weight": "['blocks']['feed_forward']['expand']['weight']",
    "expand.bias": "['blocks']['feed_forward']['expand']['bias']",
    "project.weight": "['blocks']['feed_forward']['project']['weight']",
    "project.bias": "['blocks']['feed_forward']['project']['bias']",
    "tok": "['token_embedding']['weight']",
    "pos": "['position_embedding']['weight']",
}


def _stored(short: str, want: list) -> list:
    """A block leaf's spec as stored: the layer axis (replicated) first."""
    return [None, *want] if NAMES[short].startswith("['blocks']") else want


def _norm(spec):
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return spec


@pytest.mark.parametrize("shape", MESHES)
def test_parameter_and_optimizer_shardings_follow_the_rules(report, shape):
    specs = report["meshes"][str(shape)]["specs"]
    for short, per_layer in EXPECTED[shape].items():
        want = _stored(short, per_layer)
        param = specs[".params" + NAMES[short]]
        assert _norm(param) == _norm(want), (short, param, want)
        moments = [
            v for k, v in specs.items() if k.startswith(".opt_state") and k.endswith(NAMES[short])
        ]
        assert len(moments) == 2, moments  # AdamW's mu and nu
        assert all(_norm(m) == _norm(want) for m in moments), (short, moments)
    others = [k for k in specs if not k.endswith("']")]  # step, key, Adam's count
    assert others and all(_norm(specs[k]) == [] for k in others), others


@pytest.mark.parametrize("shape", MESHES)
def test_inspect_mesh_matches_compiled_shards(report, shape, tmp_path, capsys):
    """`lmjax inspect --mesh` (sizes alone) equals the compiled step's per-device shards."""
    from lmjax import cli

    (tmp_path / "cfg.yaml").write_text(CONFIG)
    mesh = ",".join(f"{a}={n}" for a, n in zip(("data", "fsdp", "model"), shape, strict=True))
    assert cli.main(["inspect", str(tmp_path / "cfg.yaml"), "--mesh", mesh]) == 0
    text = capsys.readouterr().out.split("per device on mesh")[1]
    printed = {
        line.split()[0]: int(line.rsplit("(", 1)[1].split()[0].replace(",", ""))
        for line in text.splitlines()[1:]
        if "B)" in line
    }
    got = report["meshes"][str(shape)]
    assert printed["parameters"] == got["compiled_param_bytes"]
    assert printed["gradients"] == got["compiled_param_bytes"]
    assert printed["adamw"] == got["compiled_opt_bytes"]


def test_checkpoint_restores_onto_another_mesh(report):
    r = report["restore"]
    assert r["equal_to_saved"] and r["specs_match_target"]
    assert r["single_equal"] and r["single_devices"] == [1]


def test_hosts_rows_concatenate_to_the_global_batch(report):
    """Each simulated host's rows, read alone, tile the single-host batch exactly once."""
    from lmjax.data import prepared as data

    tokens = np.arange(5000) % 61
    whole = data.train_batch(tokens, 3, 7, 16, 16, 2)
    for n, per_host in report["host_rows"].items():
        flat = sorted(r for rows in per_host for r in rows)
        assert flat == list(range(8)), (n, per_host)
        parts = [data.train_batch(tokens, 3, 7, 16, 16, 2, rows) for rows in per_host]
        order = np.argsort([r for rows in per_host for r in rows])
        joined = np.concatenate([p["inputs"] for p in parts], axis=1)[:, order]
        np.testing.assert_array_equal(joined, whole["inputs"])
    assert report["host_batch_equal"]
    assert report["host_batch_spec"] == [None, ["data", "fsdp"], None]


def test_sharded_lmjax_train_has_the_unsharded_losses(report):
    """Train losses of every step and validation losses at steps 2 and 4; the sharded run was
    resumed from step 2 onto another mesh. rtol 1e-5: four steps of the reduction-order
    differences above (eps 1e-4 keeps Adam from amplifying them)."""
    assert report["run_meshes"] == [
        {"data": 2, "fsdp": 2, "model": 2},
        {"data": 1, "fsdp": 8, "model": 1},
    ]  # the resumed run asked for fsdp=8; the loop passes the filled-in shape
    # Evaluation batches are split over data x fsdp too (they were replicated host arrays).
    evals = report["eval_inputs"]
    assert evals["plain"] and set(map(str, evals["plain"])) == {"host"}, evals
    sharded = evals["sharded"]
    assert sharded and all(e[0] == ["data", "fsdp"] and not any(e[1:]) for e in sharded), evals
    plain, sharded = report["runs"]["plain"], report["runs"]["sharded"]
    assert [r[0] for r in plain] == [r[0] for r in sharded] and len(plain) >= 4
    # Θ: the largest per-step parameter bound of the one-step comparisons, over every mesh.
    ref, steps = report["steps"]["ref"], report["steps"]
    g_ref = clipped_gradient(ref, "adam")
    theta = max(
        float(np.max(b))
        for shape in MESHES
        for b in param_bounds(
            ref, steps[str(shape)], g_ref, clipped_gradient(steps[str(shape)], "adam"), "adam"
        ).values()
    )
    assert_losses_follow(plain, sharded, ref, theta, TAU)


if __name__ == "__main__":
    jax.config.update("jax_numpy_rank_promotion", "raise")  # as tests/conftest.py
    jax.config.update("jax_default_matmul_precision", "highest")
    print(json.dumps(_worker(Path(sys.argv[1]))))
