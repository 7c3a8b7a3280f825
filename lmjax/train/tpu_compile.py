"""A config's sharded train step compiled by the real TPU compiler on any host (`lmjax compile`).

libtpu compiles for a named TPU topology with no TPU present: `get_topology_desc("v5e:2x2")`
gives compile-only devices, a mesh over them takes the config's sharding rules, and

    jit(train_step).lower(state, batch).compile()      (abstract, sharded ShapeDtypeStructs)

runs XLA's TPU backend and Mosaic (the Pallas kernels) for real. Nothing is allocated or run,
so a config can be checked before a VM is rented. The step is `make_train_step`'s, exactly as
`lmjax train` builds it on a mesh: state pinned to the rules' shardings and donated, the batch
`[A, B, T]` split over data x fsdp, with the batch's `step` counter.

Per-device memory, from the compiled executable (`memory_analysis`):

    total = arguments + outputs - aliased + temporaries + generated code

(the donated state's outputs reuse its argument buffers: `aliased` bytes are counted once). It
must fit the HBM the compiler lets one device's program use (`TpuChip.usable_bytes`, a little
under the chip's data-sheet HBM); the compiler itself refuses a step whose buffers exceed it
(RESOURCE_EXHAUSTED), which is reported the same way.

FLOPs are XLA's cost analysis of one device's partitioned program, which counts a loop body
once. The layers are counted whole (`lmjax.train.metrics.xla_flops`): with `model.scan_layers`
the step is compiled a second time with u layers in each layer loop's body (u = 2 for an even
N), the difference is u - 1 layers' FLOPs, and the report shows N x one layer plus the rest
(`count_s`: the seconds that second compile took, not in `compile_s`; `count_layers=False`,
`lmjax compile --no-flops`, skips it and reports no XLA FLOPs). With gradient accumulation
(A > 1, a `lax.scan`) the figure covers one micro-batch of the A (`flops_per_step` scales it;
the optimizer's update is then counted A times, a few FLOPs per parameter), and the fused head
+ loss's loop over chunks of tokens is still counted once (one chunk's head and loss); the
model FLOPs (`lmjax.train.metrics.flops_per_token`, 6N + attention, per device) are printed
beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.experimental.compilation_cache import compilation_cache

from lmjax import parallel
from lmjax.config import RunConfig
from lmjax.errors import ConfigError, LMJaxError
from lmjax.models.summary import human_bytes
from lmjax.train import optim
from lmjax.train.bench import run_config_model
from lmjax.train.metrics import flops_per_token, require_layer_loop, xla_flops
from lmjax.train.step import init_state, make_train_step

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU generation as libtpu's compile-only devices present it.

    `hbm_bytes`: the chip's HBM (Cloud TPU data sheets). `usable_bytes`: what the compiler lets
    one device's program use (v2 and v3 devices are single TensorCores, half a chip; v4 and v5p
    devices are whole chips in megacore mode, as on a Cloud TPU VM), read from libtpu 0.0.42's
    RESOURCE_EXHAUSTED messages ("exceeds available HBM (15.75G)"): a few hundred MiB below
    the data sheet, reserved by the runtime.
    """

    device_kind: str
    hbm_bytes: int
    usable_bytes: int
    example: str  # a topology name of one host
    chip_config: str = "default"


TPU_CHIPS = {
    "v2": TpuChip("TPU v2", 16 * GIB, int(7.48 * GIB), "v2:2x2"),
    "v3": TpuChip("TPU v3", 32 * GIB, int(15.48 * GIB), "v3:2x2"),
    "v4": TpuChip("TPU v4", 32 * GIB, int(30.75 * GIB), "v4:2x2x1", "megacore"),
    "v5e": TpuChip("TPU v5 lite", 16 * GIB, int(15.75 * GIB), "v5e:2x2"),
    "v5p": TpuChip("TPU v5", 96 * GIB, int(95.74 * GIB), "v5p:2x2x1", "megacore"),
    "v6e": TpuChip("TPU v6 lite", 32 * GIB, int(31.25 * GIB), "v6e:2x2"),
}
_TOPOLOGY = re.compile(r"(?P<generation>[a-z0-9]+):(?P<shape>\d+(x\d+){1,2})")
# libtpu's words for a step over the HBM (0.0.42): "... the total memory required for HLO
# temporaries (31.16G) exceeds available HBM (15.75G)." (G: GiB)
_OUT_OF_HBM = re.compile(r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes of one device's compiled step (`memory_analysis`); see the module docstring."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    generated_code: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.generated_code


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What `compile_train_step` found: the target, the memory, the FLOPs, the compile time."""

    topology: str
    chip: TpuChip
    mesh: dict[str, int]
    batch: int  # sequences per micro-batch (the whole mesh's)
    grad_accum: int
    seq_len: int
    memory: DeviceMemory
    # One device, XLA's cost analysis, every layer counted (None: not counted, `_count_flops`).
    flops_per_micro_batch: float | None
    model_flops_per_step: float  # one device's share of flops_per_token x the step's tokens
    compile_s: float  # tracing + lowering + compilation, wall seconds
    finetune: str | None = None  # "LoRA", "QLoRA" or "full" for a fine-tune config's step
    n_layers: int = 1
    # One layer's forward + backward of a micro-batch on one device (XLA's count), when the
    # layers run as a loop; None: unrolled (or one layer), counted whole by XLA itself.
    flops_per_layer: float | None = None
    count_s: float = 0.0  # the second compile that counted one layer, wall seconds
    flops_note: str = ""  # why the FLOPs are not counted, when they are not

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.chip.usable_bytes

    @property
    def flops_per_step(self) -> float | None:
        if self.flops_per_micro_batch is None:
            return None
        return self.flops_per_micro_batch * self.grad_accum

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(fits=self.fits, flops_per_step=self.flops_per_step)
        out["memory"]["total"] = self.memory.total
        return out


def parse_topology(name: str) -> TpuChip:
    """`"v5e:2x2"` -> its generation's `TpuChip`; anything else is a `ConfigError` naming the
    known generations (the slice shape itself is checked by libtpu)."""
    match = _TOPOLOGY.fullmatch(name)
    if match is None or match["generation"] not in TPU_CHIPS:
        known = ", ".join(chip.example for chip in TPU_CHIPS.values())
        raise ConfigError.describe(
            "--topology",
            name,
            f"GENERATION:SHAPE for a generation in {tuple(TPU_CHIPS)}",
            f"pass one of e.g. {known} (larger slices too: v5e:4x4, v4:2x2x2)",
        )
    return TPU_CHIPS[match["generation"]]


def require_libtpu() -> None:
    """The TPU compiler is the `libtpu` package, an optional extra."""
    if importlib.util.find_spec("libtpu") is None:
        raise LMJaxError(
            "libtpu is not installed; expected the TPU compiler to compile for a TPU topology. "
            "Fix: pip install 'lmjax[tpu]' (any machine: no TPU is needed)."
        )


def topology_devices(name: str) -> list:
    """libtpu's compile-only devices of topology `name` (one per TensorCore, or per chip in
    megacore mode), in libtpu's order."""
    chip = parse_topology(name)
    require_libtpu()
    _quiet_libtpu_init()
    try:
        topology = topologies.get_topology_desc(
            topology_name=name, platform="tpu", chip_config_name=chip.chip_config
        )
    except jax.errors.JaxRuntimeError as err:  # e.g. a shape that is not a slice
        reason = str(err).splitlines()[0]
        if not reason.startswith("INVALID_ARGUMENT"):
            raise LMJaxError(f"libtpu could not start for topology {name}: {reason}") from err
        raise ConfigError.describe(
            "--topology",
            name,
            f"a slice shape libtpu knows ({reason})",
            f"use a slice shape of that generation, e.g. {chip.example}",
        ) from err
    return list(topology.devices)


def _quiet_libtpu_init() -> None:
    """libtpu's first initialisation on a host that is no TPU VM logs errors about the
    accelerator type and worker hostnames it cannot find; it reads them from the environment.
    jax sets TPU_SKIP_MDS_QUERY at import exactly when it found no TPU chip, so on a real TPU VM
    (where the metadata server answers, and the chips must be held by one process) nothing is
    set here."""
    if os.environ.get("TPU_SKIP_MDS_QUERY"):
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")  # any valid name will do
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        # Compile-only devices need no exclusive hold on a chip: let two compiles run at once.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def default_mesh(run: RunConfig, n_devices: int) -> dict[str, int]:
    """The config's `parallel.mesh`, else FSDP over every device."""
    return dict(run.parallel.mesh) if run.parallel.mesh else {"fsdp": n_devices}


def check_mesh(shape: Mapping[str, int], n_devices: int, topology: str) -> dict[str, int]:
    """The mesh, validated and completed; its product must be the topology's device count."""
    full = parallel.check_mesh_shape(shape, where="--mesh")
    if math.prod(full.values()) != n_devices:
        text = ",".join(f"{k}={v}" for k, v in full.items())
        raise ConfigError.describe(
            "--mesh",
            text,
            f"axis sizes whose product is the {n_devices} devices of topology {topology} "
            f"(got {math.prod(full.values())})",
            f"resize the axes so data x fsdp x model = {n_devices} (e.g. --mesh fsdp={n_devices})"
            " or pick a topology with that many devices",
        )
    return full


def compile_train_step(
    run: RunConfig,
    topology: str,
    mesh_shape: Mapping[str, int] | None = None,
    trainable=None,
    finetune: str | None = None,
    count_layers: bool = True,
) -> CompileReport:
    """Compile `run`'s sharded train step for `topology` (e.g. "v5e:2x2") with libtpu.

    `mesh_shape` defaults to `default_mesh`. Raises `ConfigError` for an unknown topology, a
    mesh of the wrong size, a batch the mesh cannot split, or a step the compiler refuses as out
    of HBM; `LMJaxError` when libtpu is missing. A step that compiles but exceeds the usable
    HBM is returned with `fits` False (`check_fits` raises for it).

    `trainable`: a fine-tune's `Trainable` over the base's shapes
    (`lmjax.finetune.abstract_trainable`; `run` is then its run config, the base's model), and
    `finetune` its kind for the report ("LoRA", "QLoRA", "full"): the step is `lmjax finetune`'s
    on a mesh, its trained state (adapters replicated, or a full fine-tune's unfrozen leaves by
    the rules) donated and its frozen base (float, or NF4 for QLoRA) an argument sharded by the
    rules.

    `count_layers=False` skips the second compile that counts one layer of a scanned model
    (module docstring): its XLA FLOPs are then not reported (`flops_per_micro_batch` None).
    """
    chip = parse_topology(topology)
    devices = topology_devices(topology)
    shape = check_mesh(mesh_shape or default_mesh(run, len(devices)), len(devices), topology)
    t = run.train
    micro = t.batch_size // t.grad_accum
    parallel.check_batch(micro, shape, where="batch (sequences per micro-batch)")
    model = run_config_model(run)
    tx, lr = optim.from_config(run)
    mesh = parallel.make_mesh(shape, devices)
    init, loss, frozen, count = (None,) * 4
    if trainable is not None:
        init, loss, frozen = trainable.init_params, trainable.loss, trainable.frozen
        count = trainable.flops_per_token
    abstract = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tx, init))
    state_shardings = parallel.shardings(parallel.state_specs(abstract, model, shape), mesh)
    state = jax.tree.map(_sharded, abstract, state_shardings)
    if frozen is not None:
        frozen_shardings = parallel.shardings(parallel.state_specs(frozen, model, shape), mesh)
        frozen = jax.tree.map(_sharded, frozen, frozen_shardings)
    batch_sharding = parallel.batch_sharding(mesh, 3, batch_dim=1)
    tokens = jax.ShapeDtypeStruct((t.grad_accum, micro, run.seq_len), jnp.int32)
    batch = {
        "inputs": _sharded(tokens, batch_sharding),
        "targets": _sharded(tokens, batch_sharding),
        "step": _sharded(jax.ShapeDtypeStruct((), jnp.int32), parallel.replicated(mesh)),
    }
    step = make_train_step(model, tx, lr, state_shardings, loss=loss)
    args = (state, batch, frozen)
    start = time.perf_counter()
    # The default device picks the kernels' platform (pallas_kernels._backend): Mosaic's. The
    # step traces on its state's mesh, which lmjax.models.attention shard-maps the flash kernel
    # over (XLA's partitioner cannot split a Mosaic call itself).
    with jax.default_device(devices[0]), no_persistent_cache():
        try:
            traced = step.trace(*args)
            compiled = traced.lower().compile()
        except jax.errors.JaxRuntimeError as err:
            raise _out_of_hbm(err, topology, chip) from err
        compile_s = time.perf_counter() - start
        flops, note = _count_flops(traced, args, compiled, model, count_layers)
    per_token = (count or flops_per_token)(model, run.seq_len)
    model_flops = per_token * t.batch_size * run.seq_len / len(devices)
    return CompileReport(
        topology,
        chip,
        shape,
        micro,
        t.grad_accum,
        run.seq_len,
        _device_memory(compiled.memory_analysis()),
        None if flops is None else flops.whole,
        model_flops,
        compile_s,
        finetune,
        n_layers=model.n_layers,
        flops_per_layer=None if flops is None else flops.per_layer,
        count_s=time.perf_counter() - start - compile_s,
        flops_note=note,
    )


@contextlib.contextmanager
def no_persistent_cache():
    """jax's persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`, a user's or lmjax
    train's) off while compiling for a topology: a compile-only client's executable is written
    but cannot be read back (each later run warned "PjRtCompiler must be constructed with a
    Client" and compiled again), and a hit would report reading it as the compile time. jax
    decides once per process whether the cache is used, so that decision is reset on the way in
    and out: compiles after this one use the cache as configured."""
    enabled = jax.config.jax_enable_compilation_cache
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def _count_flops(traced, args, compiled, model, count_layers: bool) -> tuple:
    """`(xla_flops of the compiled step, "")`, or `(None, why not)`: no figure rather than
    one that counts one layer for N, when the second compile is skipped or is refused as out
    of HBM (it holds u layers in the loop's body where the step, just fitting, holds one)."""
    if not count_layers and model.scan_layers and model.n_layers >= 2:
        return None, "not counted (--no-flops)"
    try:
        flops = xla_flops(traced, args, compiled, model.n_layers)
    except jax.errors.JaxRuntimeError as err:
        if not str(err).startswith("RESOURCE_EXHAUSTED"):
            raise
        return None, "not counted: counting one layer (a second compile) ran out of HBM"
    require_layer_loop(flops, model)
    return flops, ""


def _sharded(leaf, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _device_memory(stats) -> DeviceMemory:
    return DeviceMemory(
        stats.argument_size_in_bytes,
        stats.output_size_in_bytes,
        stats.alias_size_in_bytes,
        stats.temp_size_in_bytes,
        stats.generated_code_size_in_bytes,
    )


def _out_of_hbm(err: Exception, topology: str, chip: TpuChip) -> Exception:
    """The compiler's RESOURCE_EXHAUSTED as one `ConfigError` with needed vs available."""
    text = str(err)
    found = _OUT_OF_HBM.search(text)
    if not text.startswith("RESOURCE_EXHAUSTED") or found is None:
        return err
    needed, available = (float(g) * GIB for g in found.groups())
    how = "the compiler's count of its buffers"
    return not_fitting(topology, chip, int(needed), int(available), how)


def not_fitting(topology: str, chip: TpuChip, needed: int, available: int, how: str):
    return ConfigError(
        f"the train step needs {needed / GIB:.2f} GiB per device on {topology} "
        f"({chip.device_kind}; {how}); expected at most the {available / GIB:.2f} GiB of HBM "
        "a device's program may use. Fix: shrink the micro-batch (train.grad_accum up or "
        "train.batch_size down), set model.remat=block or model.attention=flash, or shard "
        "wider (--mesh, a larger topology)."
    )


def check_fits(report: CompileReport) -> None:
    """`ConfigError` (needed vs available) unless the compiled step fits one device's HBM."""
    if not report.fits:
        raise not_fitting(
            report.topology,
            report.chip,
            report.memory.total,
            report.chip.usable_bytes,
            "arguments + outputs - aliased + temporaries + code",
        )


def format_report(report: CompileReport) -> str:
    """The table `lmjax compile` prints: per-device memory against the HBM, FLOPs, time."""
    m, chip = report.memory, report.chip
    n = math.prod(report.mesh.values())
    mesh = ",".join(f"{k}={v}" for k, v in report.mesh.items())
    rows = [
        ("arguments (state, batch" + (", frozen base)" if report.finetune else ")"), m.arguments),
        ("outputs (new state, metrics)", m.outputs),
        ("  aliased (donated state, counted once)", -m.aliased),
        ("temporaries (activations, gradients, gathers)", m.temporaries),
        ("generated code", m.generated_code),
        ("total", m.total),
        (f"usable HBM ({human_bytes(chip.hbm_bytes)} per chip)", chip.usable_bytes),
    ]
    width = max(len(text) for text, _ in rows)
    what = f"a {report.finetune} fine-tune's train step, " if report.finetune else ""
    lines = [
        f"compiled {what}for {report.topology} ({n} x {chip.device_kind}), mesh {mesh}, "
        "micro-batches "
        f"of {report.batch} x {report.seq_len} tokens x {report.grad_accum} accumulated, in "
        f"{report.compile_s:.1f} s",
        "per device:",
    ]
    lines += [f"  {text:{width}}  {_signed(b):>11}  ({b:,} B)" for text, b in rows]
    lines += _flops_lines(report, width)
    lines.append(
        f"  {'model FLOPs per step (6N + attention)':{width}}  {report.model_flops_per_step:.3e}"
    )
    used = m.total / chip.usable_bytes
    lines.append(f"{'fits' if report.fits else 'does NOT fit'}: {used:.0%} of the usable HBM")
    return "\n".join(lines)


def _flops_lines(report: CompileReport, width: int) -> list[str]:
    """XLA's FLOPs per step, and per layer when the layers ran as a loop."""
    label = f"  {'FLOPs per step (XLA cost analysis)':{width}}  "
    if report.flops_per_step is None:
        return [label + report.flops_note]
    lines = [
        label
        + f"{report.flops_per_step:.3e}"
        + (
            f"  ({report.grad_accum} x {report.flops_per_micro_batch:.3e})"
            if report.grad_accum > 1
            else ""
        )
    ]
    if report.flops_per_layer is not None:  # XLA counts the layer loop's body once: N x it
        rest = report.flops_per_micro_batch - report.n_layers * report.flops_per_layer
        lines.append(
            f"    {'a micro-batch:':{width - 2}}  {report.n_layers} layers x "
            f"{report.flops_per_layer:.3e} + {rest:.3e} outside them (one layer counted "
            f"by a second compile: {report.count_s:.1f} s more)"
        )
    return lines


def _signed(nbytes: int) -> str:
    return ("-" if nbytes < 0 else "") + human_bytes(abs(nbytes))
