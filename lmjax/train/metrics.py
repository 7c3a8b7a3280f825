"""Throughput, model FLOPs utilisation, `metrics.jsonl` and the loss-curve plot.

Model FLOPs per trained token (forward + backward, the usual 6N + attention count):

    F = 6 * N_matmul + 12 * L * T * D

N_matmul counts the weights of every matrix multiply (the linear layers and the LM head; the
token table counts once as the head when tied, and never as the embedding gather). MFU is
`F * tokens_per_second / peak`, with peak the measured throughput of one large matmul on the
device in the compute dtype (or `logging.peak_flops`).

A LoRA step (`lora_flops_per_token`) does less: a frozen weight gets no gradient, so its layer
costs a forward (2N) plus an input gradient (2N) only where that input depends on an adapter;
an adapter costs 6 r (in + out); attention's backward keeps only the products whose operand
depends on an adapter. Counting 6N there overstated MFU by up to 1.5x.

XLA's own count (`xla_flops`, what `lmjax compile` prints beside F) takes a `while` loop's body
once: its cost analysis does not multiply by trip counts. With `model.scan_layers` the N blocks
are one `lax.scan` (a `while` loop), so the compiled step's figure holds one layer, not N. The
count is made whole from a second compile of the same traced step with each layer loop's body
holding u layers (its scans set to `unroll=u`: N / u trips of u layers): the two figures differ
by exactly u - 1 layers as XLA counts them inside that loop, and

    whole = counted + (N - 1) * per_layer,   per_layer = (counted_u - counted) / (u - 1).

u is the smallest divisor of N that leaves at least two trips, so that the second program keeps
the same loop around the same body (a loop of one trip, or layers left over outside the loop, is
compiled inline, where XLA counts a few element-wise operations differently); with none (N = 2,
3 or another prime) u = N: the second program has no loop, and its figure is the whole.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
from jax.extend import core as jax_core

from lmjax.errors import LMJaxError, ShapeError
from lmjax.files import atomic_open
from lmjax.models import ModelConfig, declare_layers
from lmjax.models.transformer import run_layers


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """F above for one token of a length-`seq_len` sequence. The matrices are counted per
    layer (`declare_layers`): a stored `[N, out, in]` block leaf is N of them."""
    matmul = sum(
        math.prod(spec.shape)
        for name, spec in declare_layers(cfg).items()
        if len(spec.shape) == 2 and "embedding" not in name
    )
    if cfg.tie_embeddings:
        matmul += cfg.vocab_size * cfg.d_model
    return 6.0 * matmul + 12.0 * cfg.n_layers * seq_len * cfg.d_model


# Which linear layers of a block read the block's (normed) residual stream; the others read
# the attention result (output) or the feed-forward hidden state (project, down).
_READS_RESIDUAL = {"query", "key", "value", "expand", "gate", "up"}
_READS_INSIDE = {"output", "project", "down"}


def lora_flops_per_token(
    cfg: ModelConfig, seq_len: int, adapters: Mapping[str, tuple[int, int, int]]
) -> float:
    """FLOPs per trained token of a LoRA step over a frozen base (float or NF4).

    `adapters`: `{per-layer name: (out, in, r)}` (`lmjax.lora.adapter_shapes`, names such as
    `blocks.3.attention.query`: a projection adapted in some layers counts in those only). The
    base, the embeddings and the head are frozen. With "live" meaning "depends on an adapter"
    (the residual stream is not live before the first adapter; dequantizing NF4 is not counted):

        frozen projection [out, in], N = out * in:  2N forward + 2N input gradient if its
                                                    input is live (never a weight gradient)
        adapter r x (in, out):                      2 r (in + out) forward, 2 r out (dB),
                                                    2 r out (dh), 2 r in (dA),
                                                    + 2 r in input gradient if input is live
        attention, per layer (T x T, as 12 L T D):  4 T D forward; backward 2 T D each for
                                                    dV (V live), dP (Q or K live), dQ, dK
        head [V, D]:                                2 V D forward + 2 V D input gradient

    With every adapter's input live this is 4 N_frozen + 6 N_adapter + 12 L T D.
    """
    linear = {
        name.removesuffix(".weight"): spec.shape
        for name, spec in declare_layers(cfg).items()
        if name.startswith("blocks.") and name.endswith(".weight") and len(spec.shape) == 2
    }
    unknown = sorted(set(adapters) - set(linear))
    if unknown:
        raise ShapeError.describe(
            "adapter layer",
            unknown[0],
            "a linear layer of the model's blocks",
            "pass adapter shapes made for this model (lmjax.lora.adapter_shapes)",
        )
    t, d = seq_len, cfg.d_model
    total, live = 0.0, False  # live: the residual stream depends on an adapter

    def project(name: str, input_live: bool) -> tuple[float, bool]:
        """FLOPs of one projection (and its adapter), and whether its output is live."""
        out_f, in_f = linear[name]
        flops = 2.0 * out_f * in_f * (1 + input_live)
        if name in adapters:
            _, _, r = adapters[name]
            flops += 2.0 * r * (in_f + out_f) + 4.0 * r * out_f + 2.0 * r * in_f * (1 + input_live)
        return flops, input_live or name in adapters

    for i in range(cfg.n_layers):
        block = {n.rsplit(".", 1)[1]: n for n in linear if n.startswith(f"blocks.{i}.")}
        unknown = sorted(set(block) - _READS_RESIDUAL - _READS_INSIDE)
        if unknown:  # a new layer kind: say where it reads from before counting it
            raise ValueError(f"lora_flops_per_token: unknown block layer {unknown[0]!r}")
        qkv = {}
        for leaf in ("query", "key", "value"):
            flops, qkv[leaf] = project(block[leaf], live)
            total += flops
        q, k, v = qkv["query"], qkv["key"], qkv["value"]
        total += 4.0 * t * d + 2.0 * t * d * (v + (q or k) + q + k)
        flops, attention_live = project(block["output"], q or k or v)
        total += flops
        live = live or attention_live
        hidden_live = False
        for leaf in ("expand", "gate", "up"):
            if leaf in block:
                flops, leaf_live = project(block[leaf], live)
                total += flops
                hidden_live = hidden_live or leaf_live
        flops, ff_live = project(block["project" if "project" in block else "down"], hidden_live)
        total += flops
        live = live or ff_live
    head = 2.0 * cfg.vocab_size * d
    return total + head * (1 + live)


# ---- XLA's count, every layer counted ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class XlaFlops:
    """XLA's cost analysis of one compiled program, every layer counted (module docstring).

    `counted`: the program's own figure (a layer loop's body once). `per_layer`: one layer's
    forward and backward as XLA counts them in that program, or None when the program has no
    layer loop (unrolled layers, or one layer), so that `counted` already holds every layer."""

    counted: float
    n_layers: int
    per_layer: float | None = None

    @property
    def whole(self) -> float:
        if self.per_layer is None:
            return self.counted
        return self.counted + (self.n_layers - 1) * self.per_layer

    @property
    def outside_layers(self) -> float | None:
        """Everything but the layers (embeddings, head and loss, optimizer), or None."""
        return None if self.per_layer is None else self.whole - self.n_layers * self.per_layer


def cost_flops(compiled) -> float:
    """The `flops` of a compiled program's `cost_analysis()` (a loop body counted once)."""
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs  # older jax: one dict per program
    return float(costs.get("flops", 0.0))


def layers_per_trip(n_layers: int) -> int:
    """u above: the smallest divisor u >= 2 of N with N / u >= 2, else N (1 for one layer)."""
    return next((u for u in range(2, n_layers // 2 + 1) if n_layers % u == 0), n_layers)


def xla_flops(traced, args: tuple, compiled, n_layers: int) -> XlaFlops:
    """`XlaFlops` of `compiled = traced.lower().compile()`, `traced = jitted.trace(*args)`
    (abstract `args`, sharded or not). When the program runs its layers as a loop (a
    `run_layers` scan of length `n_layers` >= 2) the same jaxpr with u layers in each layer
    loop's body is compiled once more (under the caller's default device, as the first was;
    module docstring); otherwise nothing is compiled."""
    counted = cost_flops(compiled)
    u = layers_per_trip(n_layers)
    more, found = _unroll_layer_loops(traced.jaxpr.jaxpr, n_layers, u)
    if not found or u < 2:
        return XlaFlops(counted, n_layers)
    program = jax.jit(jax_core.jaxpr_as_fun(traced.jaxpr.replace(jaxpr=more)))
    counted_u = cost_flops(program.lower(*jax.tree.leaves(args)).compile())
    return XlaFlops(counted, n_layers, (counted_u - counted) / (u - 1))


def require_layer_loop(flops: XlaFlops, cfg: ModelConfig) -> None:
    """LMJaxError when a scanned model's count found no layer loop: the figure would take one
    layer for N (a change in how `run_layers` traces, which `_is_layer_loop` must follow)."""
    if cfg.scan_layers and cfg.n_layers >= 2 and flops.per_layer is None:
        raise LMJaxError(
            f"XLA's FLOPs of a step with model.scan_layers: no layer loop (a scan of length "
            f"{cfg.n_layers} from run_layers) was found in the traced step; expected one, or "
            "its one-layer count would stand for all layers. Fix: report this as a bug; "
            "model.scan_layers=false counts without it."
        )


def _is_layer_loop(eqn, n_layers: int) -> bool:
    """A scan over the layers: one trip per layer, bound by `run_layers` itself (the first
    frame outside jax; the backward's transposed scan keeps the forward's frames). A scan inside
    a block has its own op's frame first, so a block's loop of N trips is not taken for it."""
    if eqn.primitive.name != "scan" or eqn.params["length"] != n_layers:
        return False
    frames = eqn.source_info.traceback.frames if eqn.source_info.traceback else ()
    caller = next((f for f in frames if not f.file_name.startswith(_JAX_DIRS)), None)
    code = run_layers.__code__
    return caller is not None and (caller.file_name, caller.function_name) == (
        code.co_filename,
        code.co_name,
    )


_JAX_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib))


def _unroll_layer_loops(jaxpr, n_layers: int, unroll: int):
    """`(jaxpr with every layer scan's unroll set to `unroll`, whether one was found)`, looking
    into nested jaxprs (a gradient-accumulation scan, jit and remat calls, cond branches)."""
    found = False

    def sub(value):
        nonlocal found
        if isinstance(value, jax_core.ClosedJaxpr):
            inner, hit = _unroll_layer_loops(value.jaxpr, n_layers, unroll)
            found |= hit
            return value.replace(jaxpr=inner) if hit else value
        if isinstance(value, jax_core.Jaxpr):
            inner, hit = _unroll_layer_loops(value, n_layers, unroll)
            found |= hit
            return inner if hit else value
        if isinstance(value, tuple) and any(
            isinstance(v, jax_core.ClosedJaxpr | jax_core.Jaxpr) for v in value
        ):
            return tuple(sub(v) for v in value)
        return value

    eqns = []
    for eqn in jaxpr.eqns:
        params = {name: sub(value) for name, value in eqn.params.items()}
        if _is_layer_loop(eqn, n_layers):
            params["unroll"], found = unroll, True
        eqns.append(eqn.replace(params=params))
    return jaxpr.replace(eqns=eqns), found


# The matmul size that measures a device's peak when `logging.peak_flops` is unset: on a CPU,
# 2048^3 took 1.5 s of CPU at every run's start (1.9 s in bfloat16) on a 2-core machine, and
# 1024^3 0.3 s for the same or a higher figure (93 against 76 GFLOP/s in float32).
PEAK_MATMUL_N = {"cpu": 1024}


@functools.cache
def measured_peak_flops(dtype: str = "float32", n: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` n x n x n matmuls on the default device (compiled once);
    n defaults to `PEAK_MATMUL_N` for the device's platform, else 2048."""
    n = n or PEAK_MATMUL_N.get(jax.devices()[0].platform, 2048)
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


class MetricsLog:
    """Append-only `metrics.jsonl`: one JSON object per line, each with a `step`.

    `also`: more logs (`tensorboard.TensorBoardLog`, `wandb_log.WandbLog`) that get every
    `append` and `truncate_after` too; `read` reads the file.
    """

    def __init__(self, path: str | os.PathLike, also: tuple = ()):
        self.path = Path(path)
        self.also = also

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run redoes them), atomically."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        with atomic_open(self.path, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in kept)
        for log in self.also:
            log.truncate_after(step)

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
        for log in self.also:
            log.append(record)

    def sync(self) -> None:
        """fsync the file: every record appended so far survives a power cut."""
        if self.path.exists():
            with open(self.path, "rb") as handle:
                os.fsync(handle.fileno())

    def close(self) -> None:
        for log in self.also:
            log.close()

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: the next run rewrites the file
        return records


def plot_losses(records: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """Train and validation loss against step, written atomically as a PNG."""
    # Lazy (tests/test_architecture.py's LAZY_THIRD_PARTY): matplotlib is 0.4-0.7 s of import
    # for one plot per run. A bare Figure needs no pyplot and no backend switch, so a notebook's
    # own backend is left alone.
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    with atomic_open(path, "wb") as handle:
        handle.write(buffer.getvalue())
