"""Sharded training on 8 simulated CPU devices (SPEC section 9).

XLA_FLAGS must be set before jax starts, and the suite's jax is already running, so one
subprocess (this file run as a script) does all the 8-device work at once, paying start-up and
compilation once, and prints a JSON report; the tests below assert on it.

Tolerance. One AdamW step on each mesh is compared with the single-device step: loss and
gradient norm within rtol 1e-6, parameters and Adam moments within atol 1e-6. The partitioned
step sums gradients and the loss in another order, so they differ by float32 rounding: with SGD
(no normalization) the gradients differ by <= 8.1e-7 of the largest one and the parameters by
<= 3.0e-8 (test_sgd_step_matches_single_device_to_float32_rounding, (1, 4, 2)). Adam's first
update is lr * g / (|g| + eps), which amplifies that rounding where |g| is tiny: the attention
key biases have an exactly zero gradient (softmax is invariant to a score shift shared by all
keys), computed as rounding noise ~1e-10 of either sign, and with the default eps = 1e-8 Adam
turns that noise into updates of up to ±lr. Measured with eps 1e-8, lr 1e-2 (jax 0.10.2, CPU):
largest parameter difference 4.4e-4, 4.8e-4, 5.8e-4, 4.7e-4 on the four meshes; on (1, 4, 2)
it is at a key bias whose gradient is 2.6e-10 on one device and -3.3e-10 on the mesh. The
test optimizer therefore uses eps = 1e-4, bounding the update's sensitivity to g by lr / eps:
measured largest state difference 3.1e-7 to 5.4e-7, loss 1.1e-7 relative, gradient
norm 2e-7 relative.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _background import Worker

# ~75 s of CPU in one subprocess (start-up, 4 meshes, 3 short runs): `make test`, not test-fast.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
MESHES = [(8, 1, 1), (2, 4, 1), (1, 4, 2), (1, 1, 8)]
LR, EPS = 1e-2, 1e-4
# d_ff 36: model=8 does not divide it (the rule replicates that dim); gpt: biases and learned
# positions, so 1-D leaves and the context axis are covered too.
CONFIG = f"""
model: {{preset: gpt, vocab_size: 64, context_length: 16, d_model: 32, n_heads: 4,
        n_layers: 2, d_ff: 36}}
optimizer: {{name: adamw, lr: {LR}, eps: {EPS}}}
schedule: {{warmup_steps: 0, decay: constant}}
train: {{steps: 4, batch_size: 16, seq_len: 16, grad_accum: 2, eval_every: 2, eval_batches: 1}}
checkpoint: {{every: 2}}
logging: {{every: 1, progress: false, sample_tokens: 4, sample_prompt: a, plot: false,
          peak_flops: 1.0e+12}}
"""
TEXT = "".join(
    f"line {i}: the quick brown fox jumps over the lazy dog {i % 9}\n" for i in range(80)
)


def _worker(workdir: Path) -> dict:
    """Everything that needs 8 devices; returns plain numbers, names and lists."""
    import dataclasses

    import jax.numpy as jnp

    from lmjax import cli, parallel, train
    from lmjax.config import load_run_config
    from lmjax.train import optim
    from lmjax.train.checkpoint import Checkpoints
    from lmjax.train.step import init_state, make_train_step

    assert jax.device_count() == 8, jax.devices()
    (workdir / "cfg.yaml").write_text(CONFIG)
    cfg = load_run_config(workdir / "cfg.yaml")
    model = cfg.model_config()
    tx, lr = optim.from_config(cfg)
    state0 = init_state(jax.random.PRNGKey(0), model, tx)
    batch = train.data.train_batch(
        np.arange(4000) % 64, 0, 0, cfg.train.batch_size, 16, cfg.train.grad_accum
    )
    ref, ref_m = make_train_step(model, tx, lr)(jax.tree.map(jnp.copy, state0), batch)
    ref_leaves = jax.tree.leaves(ref)
    out: dict = {"meshes": {}}

    def specs_of(tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(p): list(map(_entry, x.sharding.spec)) for p, x in flat}

    for shape in MESHES:
        mesh = parallel.make_mesh(dict(zip(parallel.AXES, shape, strict=True)))
        specs = parallel.state_specs(state0, model, parallel.mesh_shape(mesh))
        shardings = parallel.shardings(specs, mesh)
        state = jax.device_put(jax.tree.map(jnp.copy, state0), shardings)
        step = make_train_step(model, tx, lr, shardings)
        bsh = parallel.batch_sharding(mesh, 3, batch_dim=1)
        sharded_batch = {k: jax.device_put(v, bsh) for k, v in batch.items()}
        compiled = step.lower(state, sharded_batch).compile()
        out_state_sh = compiled.output_shardings[0]
        new, m = compiled(state, sharded_batch)  # the same executable: compiled once
        leaves = jax.tree.leaves(new)
        out["meshes"][str(shape)] = {
            "loss": float(m["loss"]),
            "grad_norm": float(m["grad_norm"]),
            "max_abs_diff": max(
                float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves, ref_leaves, strict=True)
            ),
            "specs": specs_of(new),
            "compiled_param_bytes": _shard_bytes(new.params, out_state_sh.params),
            "compiled_opt_bytes": _shard_bytes(new.opt_state, out_state_sh.opt_state),
            "donated": all(x.is_deleted() for x in jax.tree.leaves(state.params)),
        }
        if shape == (2, 4, 1):
            saved = new
    out["ref_loss"], out["ref_grad_norm"] = float(ref_m["loss"]), float(ref_m["grad_norm"])

    # SGD (momentum trace = the clipped gradient, no 1/sqrt(v)): the gradients themselves,
    # on the mesh with every axis kind (fsdp and model) against one device.
    sgd = cfg.replace(optimizer=dataclasses.replace(cfg.optimizer, name="sgd"))
    sgd_tx, sgd_lr = optim.from_config(sgd)
    sgd0 = init_state(jax.random.PRNGKey(0), model, sgd_tx)
    ref = make_train_step(model, sgd_tx, sgd_lr)(jax.tree.map(jnp.copy, sgd0), batch)[0]
    mesh = parallel.make_mesh({"fsdp": 4, "model": 2})
    shardings = parallel.shardings(
        parallel.state_specs(sgd0, model, parallel.mesh_shape(mesh)), mesh
    )
    bsh = parallel.batch_sharding(mesh, 3, batch_dim=1)
    new = make_train_step(model, sgd_tx, sgd_lr, shardings)(
        jax.device_put(sgd0, shardings), {k: jax.device_put(v, bsh) for k, v in batch.items()}
    )[0]

    def max_diff(a, b):
        return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b, strict=True))

    def traces(state):  # the momentum trace: the float leaves of the optimizer state
        return [x for x in jax.tree.leaves(state.opt_state) if x.dtype == jnp.float32]

    assert len(traces(ref)) == len(jax.tree.leaves(ref.params))
    out["sgd"] = {
        "param_diff": max_diff(jax.tree.leaves(new.params), jax.tree.leaves(ref.params)),
        "trace_diff": max_diff(traces(new), traces(ref)),
        "max_trace": max(float(jnp.max(jnp.abs(x))) for x in traces(ref)),
    }

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
        "equal_to_saved": all(
            bool(jnp.array_equal(a, b))
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
    whole = train.data.train_batch(tokens, 3, 7, 16, 16, 2)
    assembled = parallel.host_batch(
        lambda rows: train.data.train_batch(tokens, 3, 7, 16, 16, 2, rows), shape3, bsh
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


def _entry(e):
    return list(e) if isinstance(e, tuple) else e


def _shard_bytes(tree, shardings) -> int:
    return sum(
        int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
    )


def _worker_command(workdir: Path) -> tuple[list[str], dict]:
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=str(ROOT),
        XDG_CACHE_HOME=str(workdir / "cache"),
        JAX_PLATFORMS="cpu",
    )
    return [sys.executable, __file__, str(workdir)], env


WORKER = Worker("mesh", _worker_command)


def start_in_background(names: set[str]) -> None:
    """Called by tests/conftest.py at collection with this module's selected tests (every one
    reads the report): the ~75 s worker runs beside the suite."""
    WORKER.start()


@pytest.fixture(scope="module")
def report():
    done = WORKER.result()
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", MESHES)
def test_one_step_matches_single_device(report, shape):
    got = report["meshes"][str(shape)]
    np.testing.assert_allclose(got["loss"], report["ref_loss"], rtol=1e-6)
    # The gradient norm too: clipping (norm ~4.7 > clip_norm 1) divides the gradient by it, so
    # a gradient wrong by a constant factor would leave the state unchanged.
    np.testing.assert_allclose(got["grad_norm"], report["ref_grad_norm"], rtol=1e-6)
    assert got["max_abs_diff"] <= 1e-6, got["max_abs_diff"]
    assert got["donated"]  # the input state's buffers were given to the step


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
NAMES = {
    "query.weight": "['blocks']['0']['attention']['query']['weight']",
    "query.bias": "['blocks']['0']['attention']['query']['bias']",
    "output.weight": "['blocks']['1']['attention']['output']['weight']",
    "expand.weight": "['blocks']['1']['feed_forward']['expand']['weight']",
    "expand.bias": "['blocks']['1']['feed_forward']['expand']['bias']",
    "project.weight": "['blocks']['0']['feed_forward']['project']['weight']",
    "project.bias": "['blocks']['0']['feed_forward']['project']['bias']",
    "tok": "['token_embedding']['weight']",
    "pos": "['position_embedding']['weight']",
}


def _norm(spec):
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def test_sgd_step_matches_single_device_to_float32_rounding(report):
    """SGD on (1, 4, 2): parameters within 1e-7 (one float32 ulp at |θ| <= 1 is 1.2e-7; the
    update's own difference lr·|Δg| is ~1e-9), the momentum trace (the clipped gradient)
    within 2e-6 of its largest entry (float32 sums of the 256 per-token terms of a gradient
    entry, taken in another order). Measured: 3.0e-8 and 8.1e-7 of 0.118."""
    sgd = report["sgd"]
    assert sgd["param_diff"] <= 1e-7, sgd
    assert sgd["trace_diff"] <= 2e-6 * sgd["max_trace"], sgd


@pytest.mark.parametrize("shape", MESHES)
def test_parameter_and_optimizer_shardings_follow_the_rules(report, shape):
    specs = report["meshes"][str(shape)]["specs"]
    for short, want in EXPECTED[shape].items():
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
    from lmjax.train import data

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
    for a, b in zip(plain, sharded, strict=True):
        for x, y in zip(a[1:], b[1:], strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                np.testing.assert_allclose(y, x, rtol=1e-5)


if __name__ == "__main__":
    jax.config.update("jax_numpy_rank_promotion", "raise")  # as tests/conftest.py
    jax.config.update("jax_default_matmul_precision", "highest")
    print(json.dumps(_worker(Path(sys.argv[1]))))
