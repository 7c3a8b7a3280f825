"""Training throughput: lmjax's jitted train step against the same model in PyTorch (CPU).

One process trains the reference config (V=8192, L=4, D=256, H=4, F=1024, T=256, B=8, f32,
AdamW) three ways, alternating so that machine noise hits every system alike:

  lmjax          `lmjax.train.make_train_step` (one jit, state donated)
  torch eager    an equivalent `nn.Module` (nn.Linear / nn.LayerNorm / nn.Embedding,
                 `F.scaled_dot_product_attention(is_causal=True)`), `torch.optim.AdamW`
  torch.compile  the same module under `torch.compile` (default mode), loss included in the
                 compiled region; optimizer and clipping stay eager

and lmjax's step once more with its blocks unrolled (`model.scan_layers=false`; "lmjax" is the
default, scanned): `ratios["lmjax_scanned/lmjax_unrolled"]` is issue 44's step-time cost of
the scan (target: within 3% on these CPUs). Under the default `model.remat: auto` the scanned
side also recomputes (dots_no_batch) where the unrolled one keeps everything (none);
`--remat none` compares the two at the same policy.

Fairness. The torch model is built from the lmjax config alone (not by calling lmjax), with the
same parameter names, shapes and count (asserted), and starts from lmjax's initial weights. Both
sides use AdamW with the same lr (constant), betas, eps and weight decay, the same no-decay set
(lmjax's `optimizer.no_decay`: biases, norm scales, embeddings), global-norm clipping at 1.0,
and the same random int32 batches. Before timing, one step from identical weights on one batch
is run on every system: the losses of step 1 (same weights) and step 2 (after one AdamW update)
must agree to ~1e-5 relative, and a few updated parameters are compared; these witness numbers
go into the JSON.

Timing: `--rounds` rounds of (lmjax, torch eager, torch.compile) x `--steps` steps each, every
block synchronised (`jax.block_until_ready`; torch on CPU is synchronous). The first step of each
system (XLA compile / torch.compile) is timed separately. Reported: median seconds per step and
tokens/s per system, the ratios lmjax/torch.compile and lmjax/eager, and MFU = model FLOPs per
token (`lmjax.train.metrics.flops_per_token`: 6N + 12*L*T*D) x tokens/s / peak, with peak the
best f32 n x n matmul measured in this process with both jnp and torch (the larger is used).

    python benchmarks/train_step.py                 # reference config -> results/train_step.json
    python benchmarks/train_step.py --quick         # tiny shapes, seconds (no torch.compile)
    python benchmarks/train_step.py --steps 10 --rounds 5 --batch 8 --seq 256
    python benchmarks/train_step.py --scaling       # lmjax alone -> train_step_scaling.json

--scaling times lmjax's step alone (`lmjax.train.bench.time_train_step`, the code behind
`lmjax bench`) for the `gpt` and `llama` presets at the reference sizes, T = 128, 256, 512, 1024,
with B = --scaling-tokens / T sequences (2,048 tokens per step by default, so the rows differ by
attention length, not by batch), reporting compile seconds, tokens/s and MFU on the same measured
peak as the main mode.

Host allocator. Before JAX starts, the script sets glibc malloc to keep freed memory for reuse
(`lmjax.hostmem.keep_freed_memory`, as `lmjax train`, `finetune` and `bench` do: one arena, no
mmap'd blocks, no trimming; `--no-tune-malloc` leaves the defaults). XLA's CPU runtime allocates
each execution's temporaries afresh, and with glibc's defaults a block over the mmap threshold
(at most 32 MiB) is mmap'd and unmapped when freed, so every lmjax step page-faulted ~265 MiB of
fresh pages (68k minor faults, ~140 ms of kernel time per step on one core). The setting is
process-wide, so torch eager and torch.compile run under it too (measured on one core: eager
1,080 -> 968 ms CPU per step, torch.compile unchanged); the JSON records it under `machine.malloc`.

Run it on a quiet machine. On a loaded one torch's OpenMP threads spin-wait at every barrier while
other processes hold the cores, which can make torch steps 10-100x slower; for a trial run there,
`OMP_WAIT_POLICY=PASSIVE` (recorded in the JSON, with the load average) avoids the worst of it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# What the run's process did (the JSON's machine.malloc): set by the script entry point below,
# not at import, so a test importing this module leaves its own process as it was.
MALLOC: dict = {"tuned": False, "reason": "not run as a script"}
if __name__ == "__main__":
    # A CPU benchmark (PyTorch runs on the CPU). Where libtpu is installed (the test extra) and
    # no TPU is attached, JAX would probe for one and log libtpu's errors first.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from benchmarks._harness import write_result  # noqa: E402
from lmjax import params as ptree  # noqa: E402
from lmjax.config import OptimizerConfig, ScheduleConfig  # noqa: E402
from lmjax.hostmem import keep_freed_memory  # noqa: E402
from lmjax.models import ModelConfig, param_count, preset  # noqa: E402
from lmjax.train import bench, init_state, make_train_step, optim  # noqa: E402
from lmjax.train.metrics import flops_per_token, measured_peak_flops  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REFERENCE = dict(vocab=8192, layers=4, d_model=256, heads=4, d_ff=1024, seq=256, batch=8)
QUICK = dict(vocab=256, layers=2, d_model=64, heads=2, d_ff=256, seq=32, batch=2)
WITNESS_PARAMS = (
    "token_embedding.weight",
    "blocks.0.attention.query.weight",
    "blocks.0.feed_forward.expand.bias",
    "final_norm.scale",
    "language_model_head.weight",
)
N_BATCHES = 4  # distinct random batches, cycled


# ---- the PyTorch model ---------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.query, self.key, self.value = (nn.Linear(d, d, bias=cfg.bias) for _ in range(3))
        self.output = nn.Linear(d, d, bias=cfg.bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b, t, d = x_BTD.shape
        q, k, v = (
            proj(x_BTD).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
            for proj in (self.query, self.key, self.value)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
        return self.output(out.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.expand = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.project = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.project(F.gelu(self.expand(x_BTD), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.d_model, eps=cfg.eps, bias=cfg.bias)
        self.attention = Attention(cfg)
        self.feed_forward_norm = nn.LayerNorm(cfg.d_model, eps=cfg.eps, bias=cfg.bias)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attention(self.attention_norm(x_BTD))
        return x_BTD + self.feed_forward(self.feed_forward_norm(x_BTD))


class TorchGPT(nn.Module):
    """Pre-LayerNorm GPT with learned positions and an untied head: `(tokens, targets) -> loss`.

    Parameter names equal lmjax's except that a LayerNorm's `scale` is torch's `weight`.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        unsupported = (
            cfg.norm != "layernorm"
            or cfg.activation not in ("gelu", "gelu_tanh")
            or cfg.positions != "learned"
            or cfg.tie_embeddings
            or cfg.dropout != 0.0
        )
        if unsupported:
            raise ValueError("the torch model covers the gpt preset only (see TorchGPT)")
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position_embedding = nn.Embedding(cfg.context_length, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=cfg.eps, bias=cfg.bias)
        self.language_model_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.head_bias)

    def forward(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        t = tokens_BT.shape[1]
        x = self.token_embedding(tokens_BT) + self.position_embedding.weight[:t][None]
        for blk in self.blocks:
            x = blk(x)
        logits = self.language_model_head(self.final_norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets_BT.view(-1))


def torch_name(lmjax_name: str) -> str:
    return lmjax_name[: -len(".scale")] + ".weight" if lmjax_name.endswith(".scale") else lmjax_name


def build_torch(cfg: ModelConfig, flat: dict[str, np.ndarray], opt: OptimizerConfig, decay):
    """The torch model holding `flat` (lmjax names -> arrays) and its AdamW (same groups)."""
    model = TorchGPT(cfg)
    names = {torch_name(n): n for n in flat}
    theirs = dict(model.named_parameters())
    assert set(theirs) == set(names), sorted(set(theirs) ^ set(names))
    n_torch = sum(p.numel() for p in theirs.values())
    n_lmjax = sum(a.size for a in flat.values())
    assert n_torch == n_lmjax, (n_torch, n_lmjax)
    model.load_state_dict({tn: torch.from_numpy(flat[n].copy()) for tn, n in names.items()})
    groups = [
        {
            "params": [p for tn, p in theirs.items() if decay[names[tn]]],
            "weight_decay": opt.weight_decay,
        },
        {"params": [p for tn, p in theirs.items() if not decay[names[tn]]], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=opt.lr, betas=(opt.b1, opt.b2), eps=opt.eps)
    try:
        tx = torch.optim.AdamW(groups, fused=True, **kwargs)  # the fastest CPU AdamW
        impl = "fused"
    except (RuntimeError, TypeError):
        tx = torch.optim.AdamW(groups, **kwargs)
        impl = "default"
    return model, tx, impl, n_torch


def torch_step_fn(loss_fn, model: nn.Module, tx: torch.optim.Optimizer, clip: float):
    params = list(model.parameters())

    def step(tokens, targets):
        loss = loss_fn(tokens, targets)
        tx.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        tx.step()
        return loss.detach(), grad_norm

    return step


# ---- machine, peak ------------------------------------------------------------------------------


def physical_cores() -> int:
    cores = set()
    phys = core = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                phys = line.split(":")[1].strip()
            elif line.startswith("core id"):
                core = line.split(":")[1].strip()
                cores.add((phys, core))
    except OSError:
        pass
    n = len(cores) or os.cpu_count() or 1
    return min(n, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else n


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int) -> dict:
    import optax

    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical_cores(),
        "torch_threads": threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
        "optax": optax.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", ""),
        "malloc": MALLOC,
        "loadavg_at_start": list(os.getloadavg()),
        "torch_mkldnn": torch.backends.mkldnn.is_available(),
        "torch_parallel_info": torch.__config__.parallel_info().splitlines()[:6],
    }


def _version(dist: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def torch_peak_flops(n: int, repeats: int = 5) -> float:
    a = torch.ones(n, n)
    torch.mm(a, a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


# ---- the benchmark -------------------------------------------------------------------------------


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="timed steps per system per round")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, no torch.compile (smoke)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    ap.add_argument("--output", default=None, help="file name (default train_step[_quick].json)")
    for name in REFERENCE:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (physical cores)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--remat", default=None, help="model.remat for lmjax (default: auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scaling", action="store_true", help="lmjax alone over T and presets")
    ap.add_argument(
        "--no-tune-malloc",
        action="store_true",
        help="leave glibc malloc's defaults (read at import; see 'Host allocator')",
    )
    ap.add_argument(
        "--scaling-tokens", type=int, default=None, help="tokens per step (--scaling; 2048)"
    )
    return ap.parse_args(argv)


SCALING_T = (128, 256, 512, 1024)
QUICK_SCALING_T = (16,)


def float32_preset(name: str, shapes: dict, context_length: int) -> ModelConfig:
    """The `name` preset at the benchmark's shapes (QUICK/REFERENCE keys), all in float32."""
    return preset(
        name,
        vocab_size=shapes["vocab"],
        context_length=context_length,
        d_model=shapes["d_model"],
        n_heads=shapes["heads"],
        n_layers=shapes["layers"],
        d_ff=shapes["d_ff"],
        dtype="float32",
        param_dtype="float32",
    )


def scaling(args: argparse.Namespace) -> dict:
    """tokens/s and MFU of lmjax's step for T in SCALING_T x presets (gpt, llama)."""
    shapes = {k: (getattr(args, k) or v) for k, v in (QUICK if args.quick else REFERENCE).items()}
    machine = machine_info(torch.get_num_threads())  # before the runs: loadavg_at_start
    steps = args.steps or (2 if args.quick else 5)
    tokens = args.scaling_tokens or (64 if args.quick else 2048)
    n_peak = 512 if args.quick else 2048
    peaks = {
        "jax_matmul": measured_peak_flops("float32", n=n_peak),
        "torch_matmul": torch_peak_flops(n_peak),
    }
    peak = max(peaks.values())
    rows = []
    for name in ("gpt", "llama"):
        for t in QUICK_SCALING_T if args.quick else SCALING_T:
            cfg = float32_preset(name, shapes, context_length=t)
            r = bench.time_train_step(
                cfg,
                batch_size=max(1, tokens // t),
                seq_len=t,
                steps=steps,
                optimizer=OptimizerConfig(name="adamw", lr=args.lr),
                peak_flops=peak,
                seed=args.seed,
            )
            row = {"preset": name, "seq_len": t, "batch_size": r["batch_size"]}
            for key in ("tokens_per_step", "compile_s", "median_step_s", "tokens_per_s", "mfu"):
                row[key] = r[key]
            row["flops_per_token"] = r["flops_per_token"]
            row["n_params"] = param_count(cfg)
            row["step_s"] = r["step_s"]
            rows.append(row)
            print(
                f"{name:5s} T={t:<5d} B={row['batch_size']:<3d} compile {row['compile_s']:5.1f}s "
                f"step {row['median_step_s'] * 1e3:7.1f} ms  {row['tokens_per_s']:8,.0f} tok/s  "
                f"MFU {row['mfu']:.1%}",
                flush=True,
            )
    result = {
        "benchmark": "train_step_scaling",
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "shapes": {k: v for k, v in shapes.items() if k not in ("seq", "batch")},
        "tokens_per_step_target": tokens,
        "steps": steps,
        "peak_flops": {**peaks, "used": peak},
        "rows": rows,
        "loadavg_at_end": list(os.getloadavg()),
    }
    default = "train_step_scaling_quick.json" if args.quick else "train_step_scaling.json"
    path = args.results_dir / (args.output or default)
    write_result(path, result)
    result["path"] = str(path)
    print(f"wrote {path}")
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.scaling:
        torch.set_num_threads(args.threads or physical_cores())
        return scaling(args)
    shapes = {k: (getattr(args, k) or v) for k, v in (QUICK if args.quick else REFERENCE).items()}
    steps = args.steps or (2 if args.quick else 10)
    rounds = args.rounds or (2 if args.quick else 5)
    use_compile = not (args.no_compile or args.quick)
    threads = args.threads or physical_cores()
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    machine = machine_info(threads)

    cfg = float32_preset("gpt", shapes, context_length=shapes["seq"])
    if args.remat is not None:  # both lmjax sides (scanned and unrolled) run this policy
        cfg = cfg.replace(remat=args.remat)
    b, t = shapes["batch"], shapes["seq"]
    tokens_per_step = b * t
    opt = OptimizerConfig(name="adamw", lr=args.lr)
    lr = optim.schedule(ScheduleConfig(warmup_steps=0, decay="constant"), opt.lr, 1)
    tx = optim.optimizer(opt, lr)

    # Batches: the same int32 tokens for everyone (torch needs int64 ids; converted once here).
    rng = np.random.default_rng(args.seed)
    np_batches = [
        (
            rng.integers(0, cfg.vocab_size, (b, t), dtype=np.int32),
            rng.integers(0, cfg.vocab_size, (b, t), dtype=np.int32),
        )
        for _ in range(N_BATCHES)
    ]
    jax_batches = [
        {"inputs": jnp.asarray(x[None]), "targets": jnp.asarray(y[None])} for x, y in np_batches
    ]
    torch_batches = [
        (torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64)))
        for x, y in np_batches
    ]

    # lmjax state, and the torch models from the same initial weights.
    state = init_state(jax.random.PRNGKey(args.seed), cfg, tx)
    # Per-layer names (the torch model's layers), sliced from lmjax's stacked blocks.
    flat0 = {n: np.array(a) for n, a in ptree.flatten(ptree.unstack(state.params)).items()}
    decay_stacked = ptree.flatten(optim.decay_mask(state.params, opt.no_decay))
    decay = {n: decay_stacked[ptree.stored_name(n)] for n in flat0}
    train_step = make_train_step(cfg, tx, lr)

    systems: dict[str, dict] = {}
    eager_model, eager_tx, optim_impl, n_params = build_torch(cfg, flat0, opt, decay)
    systems["torch_eager"] = {"step": torch_step_fn(eager_model, eager_model, eager_tx, 1.0)}
    compile_error = None
    if use_compile:
        comp_model, comp_tx, _, _ = build_torch(cfg, flat0, opt, decay)
        compiled = torch.compile(comp_model)
        systems["torch_compile"] = {"step": torch_step_fn(compiled, comp_model, comp_tx, 1.0)}

    # ---- witness: step 1 (same weights) and step 2 (after one update) on batch 0, + compile time
    x0j, (x0t, y0t) = jax_batches[0], torch_batches[0]
    witness: dict = {"batch": 0, "params_compared": list(WITNESS_PARAMS)}
    start = time.perf_counter()
    state, m1 = train_step(state, x0j)
    jax.block_until_ready((state, m1))
    first_step = {"lmjax": time.perf_counter() - start}
    flat1 = {n: np.array(ptree.flatten(ptree.unstack(state.params))[n]) for n in WITNESS_PARAMS}
    state, m2 = train_step(state, x0j)
    jax.block_until_ready((state, m2))
    witness["lmjax"] = {
        "loss_step1": float(m1["loss"]),
        "loss_step2": float(m2["loss"]),
        "grad_norm_step1": float(m1["grad_norm"]),
    }
    # The same model with its blocks unrolled (model.scan_layers=false, issue 44), from the
    # same initial weights: same losses to float32 rounding, timed in the same rounds.
    unrolled_cfg = cfg.replace(scan_layers=False)
    unrolled_step = make_train_step(unrolled_cfg, tx, lr)
    state_u = init_state(jax.random.PRNGKey(args.seed), unrolled_cfg, tx)
    start = time.perf_counter()
    state_u, u1 = unrolled_step(state_u, x0j)
    jax.block_until_ready((state_u, u1))
    first_step["lmjax_unrolled"] = time.perf_counter() - start
    state_u, u2 = unrolled_step(state_u, x0j)
    witness["lmjax_unrolled"] = {
        "loss_step1": float(u1["loss"]),
        "loss_step2": float(u2["loss"]),
        "loss_step2_rel_diff_from_scanned": rel(float(u2["loss"]), float(m2["loss"])),
    }
    for name in list(systems):
        step = systems[name]["step"]
        model = eager_model if name == "torch_eager" else comp_model
        start = time.perf_counter()
        try:
            l1, g1 = step(x0t, y0t)
        except Exception as e:  # torch.compile may not work on every machine
            compile_error = f"{type(e).__name__}: {e}"[:2000]
            print(f"torch.compile failed, skipped: {compile_error}", file=sys.stderr)
            del systems[name]
            continue
        first_step[name] = time.perf_counter() - start
        with torch.no_grad():
            p1 = {n: model.get_parameter(torch_name(n)).numpy().copy() for n in WITNESS_PARAMS}
        l2, _ = step(x0t, y0t)
        lw = witness["lmjax"]
        entry = {
            "loss_step1": float(l1),
            "loss_step2": float(l2),
            "grad_norm_step1": float(g1),
            "loss_step1_rel_diff": rel(lw["loss_step1"], float(l1)),
            "loss_step2_rel_diff": rel(lw["loss_step2"], float(l2)),
            "grad_norm_rel_diff": rel(lw["grad_norm_step1"], float(g1)),
            "params_after_step1": {},
        }
        for n in WITNESS_PARAMS:
            # Step 1 of Adam moves each entry by ~lr * g / (|g| + eps): entries whose gradient is
            # at round-off level (|g| ~ eps) may differ by a fraction of lr, so the differences
            # are given in units of lr (max and 99th percentile) as well as relative to the update.
            diff = np.abs(flat1[n] - p1[n])
            upd_t = p1[n] - flat0[n]
            entry["params_after_step1"][n] = {
                "max_abs_diff": float(diff.max()),
                "max_abs_diff_over_lr": float(diff.max() / opt.lr),
                "p99_abs_diff_over_lr": float(np.percentile(diff, 99) / opt.lr),
                "update_rel_diff": float(diff.max() / max(np.abs(upd_t).max(), 1e-30)),
            }
        witness[name] = entry
        worst = max(v["max_abs_diff_over_lr"] for v in entry["params_after_step1"].values())
        print(
            f"witness {name}: loss1 lmjax {lw['loss_step1']:.7f} torch {float(l1):.7f} "
            f"(rel {entry['loss_step1_rel_diff']:.1e}); loss2 lmjax {lw['loss_step2']:.7f} "
            f"torch {float(l2):.7f} (rel {entry['loss_step2_rel_diff']:.1e}); "
            f"params after step 1: max |diff| {worst:.1e} lr"
        )

    # ---- alternating timed rounds
    # lmjax's two sides (scanned, unrolled): [step, state], the state replaced as it goes.
    lmjax_sides = {"lmjax": [train_step, state], "lmjax_unrolled": [unrolled_step, state_u]}

    def run_lmjax(name: str, n: int, offset: int) -> float:
        step, st = lmjax_sides[name]
        start = time.perf_counter()
        for i in range(n):
            st, metrics = step(st, jax_batches[(offset + i) % N_BATCHES])
        jax.block_until_ready((st, metrics))
        lmjax_sides[name][1] = st
        return time.perf_counter() - start

    def run_torch(step, n: int, offset: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            loss, _ = step(*torch_batches[(offset + i) % N_BATCHES])
        float(loss)
        return time.perf_counter() - start

    names = ["lmjax", "lmjax_unrolled", *systems]
    per_round: dict[str, list[float]] = {n: [] for n in names}
    # Process CPU seconds per step too: on a shared machine they move much less than the wall
    # clock (waiting for a core costs no CPU time), though spin-waiting threads still add some.
    cpu_round: dict[str, list[float]] = {n: [] for n in names}

    def timed(name, fn, *a):
        cpu = time.process_time()
        per_round[name].append(fn(*a) / steps)
        cpu_round[name].append((time.process_time() - cpu) / steps)

    for r in range(rounds):
        offset = r * steps
        timed("lmjax", run_lmjax, "lmjax", steps, offset)
        timed("lmjax_unrolled", run_lmjax, "lmjax_unrolled", steps, offset)
        for name, sys_ in systems.items():
            timed(name, run_torch, sys_["step"], steps, offset)
        print(
            f"round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {per_round[n][-1] * 1e3:.1f} ms/step" for n in names)
        )

    # ---- peak and summary
    n_peak = 512 if args.quick else 2048
    peaks = {
        "jax_matmul": measured_peak_flops("float32", n=n_peak),
        "torch_matmul": torch_peak_flops(n_peak),
    }
    peak = max(peaks.values())
    fpt = flops_per_token(cfg, t)
    median_s = {n: statistics.median(v) for n, v in per_round.items()}
    tokens_s = {n: tokens_per_step / s for n, s in median_s.items()}
    mfu = {n: fpt * tps / peak for n, tps in tokens_s.items()}
    ratios = {}
    if "torch_compile" in tokens_s:
        ratios["lmjax/torch_compile"] = tokens_s["lmjax"] / tokens_s["torch_compile"]
    ratios["lmjax/torch_eager"] = tokens_s["lmjax"] / tokens_s["torch_eager"]
    ratios["lmjax_scanned/lmjax_unrolled"] = tokens_s["lmjax"] / tokens_s["lmjax_unrolled"]
    if "torch_compile" in tokens_s:
        ratios["torch_compile/torch_eager"] = tokens_s["torch_compile"] / tokens_s["torch_eager"]

    result = {
        "benchmark": "train_step",
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "config": {
            "model": cfg.to_dict(),
            "batch_size": b,
            "seq_len": t,
            "tokens_per_step": tokens_per_step,
            "n_params": n_params,
            "flops_per_token": fpt,
            "optimizer": {
                "name": "adamw",
                "lr": opt.lr,
                "schedule": "constant",
                "b1": opt.b1,
                "b2": opt.b2,
                "eps": opt.eps,
                "weight_decay": opt.weight_decay,
                "no_decay": list(opt.no_decay),
                "clip_norm": opt.clip_norm,
                "n_decayed_leaves": int(sum(decay.values())),
                "n_leaves": len(decay),
            },
            "torch_optimizer_impl": optim_impl,
            "torch_attention": "F.scaled_dot_product_attention(is_causal=True)",
            "lmjax_attention": cfg.attention,
            "steps_per_round": steps,
            "rounds": rounds,
            "order_per_round": names,
        },
        "first_step_s": first_step,  # lmjax: trace + XLA compile + one step
        "torch_compile_error": compile_error,
        "torch_compile_skipped": None if use_compile else "--quick or --no-compile",
        "witness": witness,
        "per_round_s_per_step": per_round,
        "median_s_per_step": median_s,
        "per_round_cpu_s_per_step": cpu_round,
        "median_cpu_s_per_step": {n: statistics.median(v) for n, v in cpu_round.items()},
        "tokens_per_s": tokens_s,
        "peak_flops": {**peaks, "used": peak},
        "mfu": mfu,
        "loadavg_at_end": list(os.getloadavg()),
        "ratios": ratios,
    }
    path = args.results_dir / (
        args.output or ("train_step_quick.json" if args.quick else "train_step.json")
    )
    write_result(path, result)
    result["path"] = str(path)
    print(
        "tokens/s: "
        + ", ".join(f"{n} {tokens_s[n]:,.0f} (MFU {mfu[n]:.1%})" for n in names)
        + f"; peak {peak / 1e9:.1f} GFLOP/s; "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
    )
    print("first step (compile): " + ", ".join(f"{k} {v:.1f}s" for k, v in first_step.items()))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    MALLOC = (
        {"tuned": False, "reason": "--no-tune-malloc"}
        if "--no-tune-malloc" in sys.argv[1:]
        else keep_freed_memory()
    )
    main()
