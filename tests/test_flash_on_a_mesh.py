"""The flash kernel on a device mesh (issue 22): `lmjax.models.attention` shard-maps it over the
batch axes (data, fsdp) and the heads (model) of the mesh in context, because XLA's partitioner
cannot split a Mosaic call (tests/test_compile_tpu.py compiles it for a TPU topology).

Here, on fake CPU devices (a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4,
the kernel interpreted): the loss and every gradient of a tiny flash model on a data=2 x model=2
mesh equal those on one device, to a derived float32 bound (below), and so do the train step's
loss and gradient norm when its state is sharded on that mesh (the step traces on its state's
mesh, lmjax.train.step) and the eval step's loss on that mesh. The subprocess costs ~20 s (three
jitted forward+backward passes of a 1-layer model and one eval pass); the rest is pure Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from _xla_flags import host_devices

from lmjax import models, testing
from lmjax.errors import ConfigError
from lmjax.models import attention, sharding
from lmjax.parallel import mesh as parallel_mesh

ROOT = Path(__file__).resolve().parents[1]
# The mesh splits sums (batch rows over data, heads over model) that one device adds in another
# order. lmjax.testing.f32_rtol bounds either program's rounding on any CPU, relative to max(1,
# |one device's|): the loss's chain is SCRIPT's model's forward, then V and the mean over 4 x 16
# tokens (1.2e-5); a gradient's, that and the backward, summed over the tokens (1.7e-5). A
# shard's part lost or counted twice moves the loss by O(1/2) of itself.
_CFG = models.ModelConfig(
    vocab_size=32, context_length=16, d_model=32, n_heads=2, n_layers=1, d_ff=64, attention="flash"
)
_CHAIN = testing.forward_chain(_CFG, 16) + 32 + 64
LOSS_RTOL, GRAD_RTOL = testing.f32_rtol(_CHAIN), testing.f32_rtol(2 * _CHAIN + 64)

# One device, then a data=2 x model=2 mesh over 4 fake CPU devices; prints a JSON summary.
SCRIPT = r"""
import json

import jax
import jax.numpy as jnp
import numpy as np

import optax

from lmjax import models, ops, parallel
from lmjax.train.step import global_norm, init_state, make_eval_step, make_train_step

cfg = models.ModelConfig(
    vocab_size=32, context_length=16, d_model=32, n_heads=2, n_layers=1, d_ff=64,
    attention="flash",
)
key = jax.random.PRNGKey(0)
params = models.init(key, cfg)
tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, cfg.vocab_size)
inputs, targets = tokens[:, :-1], tokens[:, 1:]


def loss(params, inputs, targets):
    return ops.cross_entropy(models.forward(params, inputs, cfg), targets)


step = jax.jit(jax.value_and_grad(loss))
one_loss, one_grads = step(params, inputs, targets)

shape = {"data": 2, "fsdp": 1, "model": 2}
mesh = parallel.make_mesh(shape)
rows = parallel.batch_sharding(mesh, 2)
with jax.set_mesh(mesh):
    jaxpr = str(jax.make_jaxpr(jax.value_and_grad(loss))(params, inputs, targets))
    mesh_loss, mesh_grads = jax.jit(jax.value_and_grad(loss))(
        params, jax.device_put(inputs, rows), jax.device_put(targets, rows)
    )


# The train step on that mesh, as `lmjax train` builds it: it traces on its state's mesh
# (lmjax.train.step), so the same shard_map happens without a jax.set_mesh around it.
tx = optax.sgd(0.1)
state_specs = parallel.state_specs(jax.eval_shape(lambda: init_state(key, cfg, tx)), cfg, shape)
state_sharding = parallel.shardings(state_specs, mesh)
train_step = make_train_step(cfg, tx, optax.constant_schedule(0.1), state_sharding)
state = jax.device_put(init_state(key, cfg, tx, lambda _: params), state_sharding)
# The eval step `lmjax train` builds on the same mesh (make_eval_step(cfg, mesh)), run before
# the train step donates its state (and with it these params' buffers).
eval_step = make_eval_step(cfg, mesh)
eval_params = jax.device_put(params, state_sharding.params)
eval_jaxpr = str(jax.make_jaxpr(eval_step)(eval_params, inputs, targets))
eval_loss = eval_step(eval_params, jax.device_put(inputs, rows), jax.device_put(targets, rows))
tokens_sharding = parallel.batch_sharding(mesh, 3, batch_dim=1)
batch = {"inputs": inputs[None], "targets": targets[None]}  # one micro-batch
batch = {name: jax.device_put(a, tokens_sharding) for name, a in batch.items()}
step_jaxpr = str(jax.make_jaxpr(train_step)(state, batch))
_, metrics = train_step(state, batch)


def err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


errors = jax.tree.map(err, mesh_grads, one_grads)
print(json.dumps({
    "devices": jax.device_count(),
    "shard_maps": jaxpr.count("shard_map"),
    "loss": [float(one_loss), float(mesh_loss)],
    "step_shard_maps": step_jaxpr.count("shard_map"),
    "step_loss": float(metrics["loss"]),
    "eval_shard_maps": eval_jaxpr.count("shard_map"),
    "eval_loss": float(eval_loss),
    "grad_norm": [float(global_norm(one_grads)), float(metrics["grad_norm"])],
    "grad_errors": {jax.tree_util.keystr(k): v for k, v in jax.tree.leaves_with_path(errors)},
    "grad_max": max(float(np.max(np.abs(g))) for g in jax.tree.leaves(one_grads)),
}))
"""


def test_flash_on_a_4_device_mesh_gives_the_one_device_loss_and_gradients():
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": host_devices(4),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    # The kernel ran shard-mapped (forward, and its transpose in the backward), not whole.
    assert result["shard_maps"] >= 1, "flash was not shard-mapped on the mesh"
    one, mesh = result["loss"]
    assert abs(mesh - one) <= LOSS_RTOL * max(1.0, abs(one)), result["loss"]
    assert result["grad_max"] > 0  # the gradients compared are not all zero
    # The train step (state sharded on the mesh, no jax.set_mesh): shard-mapped, same numbers.
    assert result["step_shard_maps"] >= 1, "the train step did not trace on its state's mesh"
    assert abs(result["step_loss"] - one) <= LOSS_RTOL * max(1.0, abs(one))
    # The eval step on that mesh: shard-mapped too (on TPU an unwrapped Mosaic call would not
    # compile), same loss.
    assert result["eval_shard_maps"] >= 1, "the eval step did not trace on the mesh"
    assert abs(result["eval_loss"] - one) <= LOSS_RTOL * max(1.0, abs(one)), result["eval_loss"]
    norm_one, norm_step = result["grad_norm"]
    assert abs(norm_step - norm_one) <= GRAD_RTOL * max(1.0, norm_one), result["grad_norm"]
    assert len(result["grad_errors"]) >= 8, result["grad_errors"]  # every parameter's gradient
    bad = {k: v for k, v in result["grad_errors"].items() if not v <= GRAD_RTOL}
    assert not bad, bad


def test_the_axis_names_are_the_meshs():
    """models/ sits below parallel/, so it states the axis names; they must be the mesh's."""
    assert attention.BATCH_AXES == parallel_mesh.BATCH_AXES == sharding.BATCH_AXES
    assert attention.HEAD_AXIS in parallel_mesh.AXES
    assert attention.HEAD_AXIS not in attention.BATCH_AXES


@pytest.mark.parametrize(
    ("mesh", "batch", "heads", "split"),
    [
        ({"data": 2, "fsdp": 2, "model": 1}, 8, 3, (("data", "fsdp"), None)),
        ({"data": 1, "fsdp": 4, "model": 2}, 4, 6, (("fsdp",), "model")),
        ({"data": 1, "fsdp": 1, "model": 4}, 3, 4, ((), "model")),
    ],
)
def test_mesh_split_shards_rows_and_heads_over_the_axes_that_split_them(mesh, batch, heads, split):
    assert attention.mesh_split(mesh, batch, heads) == split


@pytest.mark.parametrize(
    ("mesh", "batch", "heads", "words"),
    [
        ({"data": 2, "fsdp": 2, "model": 1}, 6, 4, "batch rows of flash attention.* = 6;.*= 4"),
        ({"data": 1, "fsdp": 2, "model": 2}, 4, 3, "heads of flash attention.* = 3;.*model = 2"),
    ],
)
def test_a_batch_or_heads_the_mesh_cannot_split_is_one_config_error(mesh, batch, heads, words):
    with pytest.raises(ConfigError, match=words) as caught:
        attention.mesh_split(mesh, batch, heads)
    assert len(str(caught.value).splitlines()) == 1 and "model.attention=xla" in str(caught.value)


def test_without_a_mesh_flash_is_not_shard_mapped():
    q = jnp.ones((2, 4, 2, 8))
    fn = lambda q: models.dot_product_attention(q, q, q, causal=True, impl="flash")  # noqa: E731
    assert "shard_map" not in str(jax.make_jaxpr(fn)(q))
