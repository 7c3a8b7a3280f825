"""Attention memory as the sequence grows: materialized vs XLA vs the Pallas flash kernel.

Nothing here is timed on CPU (the flash kernel only runs interpreted there, which says nothing
about its speed). Memory is read from compiled programs instead, without allocating anything:

  residual bytes  the arrays `jax.vjp` keeps for the backward pass (`jax.eval_shape` of the
                  pullback), i.e. what training holds per attention layer between the passes
  temp bytes      `memory_analysis()` of the compiled forward+backward (`jit(grad(loss))`):
                  XLA's scratch for the whole step
  args_out_temp   arguments + outputs + temp bytes of that program (a plain sum, an upper
                  bound: buffers that are never live at once are all counted)
  peak memory     `memory_analysis().peak_memory_in_bytes` (`peak_memory_bytes`), recorded
                  when this jax/backend reports it. Read it with care: on CPU (jax 0.10-0.11)
                  it is about arguments + outputs and leaves out the temp buffers, so it grows
                  ~T^1 for every impl; temp bytes stay the figure that shows the [T, S] scores

A log-log fit of bytes against T gives the growth exponent: about 2 when the [T, S] scores or
probabilities are kept, about 1 for flash (q, k, v, out and the logsumexp only).
On a GPU (`jax.default_backend() == "gpu"`) each point is also timed (forward+backward, median).

    python benchmarks/attention.py   # -> benchmarks/results/attention_memory.{json,png}
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from benchmarks._harness import parser, write_result  # noqa: E402
from lmjax import models  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
IMPLS = ("materialized", "xla", "flash")
MB = 2.0**20


def attend(impl: str):
    return lambda q, k, v: models.dot_product_attention(q, k, v, causal=True, impl=impl)


def residual_bytes(impl: str, spec) -> int:
    """Bytes of every array the VJP saves (traced abstractly: nothing is allocated)."""
    pullback = jax.eval_shape(lambda q, k, v: jax.vjp(attend(impl), q, k, v)[1], spec, spec, spec)
    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(pullback)))


def forward_backward(impl: str):
    def loss(q, k, v):
        return jnp.sum(attend(impl)(q, k, v).astype(jnp.float32))

    return jax.jit(jax.grad(loss, (0, 1, 2)))


def compiled_bytes(impl: str, spec) -> dict[str, int]:
    """`memory_analysis()` of the compiled forward+backward; keys get a `_bytes` suffix."""
    memory = forward_backward(impl).lower(spec, spec, spec).compile().memory_analysis()
    sizes = {
        "temp": memory.temp_size_in_bytes,
        "arguments": memory.argument_size_in_bytes,
        "outputs": memory.output_size_in_bytes,
    }
    sizes["args_out_temp"] = sum(sizes.values())
    peak = getattr(memory, "peak_memory_in_bytes", None)  # absent from older jaxlibs
    if isinstance(peak, int) and peak > 0:
        sizes["peak_memory"] = peak
    return sizes


def time_ms(impl: str, spec, repeats: int = 10) -> float:
    """Median wall time of one forward+backward (GPU only)."""
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(spec.shape), spec.dtype) for _ in range(3)]
    step = forward_backward(impl)
    jax.block_until_ready(step(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def slope(seq_lens, values) -> float:
    """Exponent p of values ~ T^p (least squares on log-log)."""
    return float(np.polyfit(np.log(seq_lens), np.log(values), 1)[0])


def measure(seq_lens, batch, heads, head_dim, dtype, timed: bool) -> dict:
    rows = []
    for t in seq_lens:
        spec = jax.ShapeDtypeStruct((batch, t, heads, head_dim), dtype)
        for impl in IMPLS:
            row = {"impl": impl, "T": t, "residual_bytes": residual_bytes(impl, spec)}
            row.update({f"{k}_bytes": v for k, v in compiled_bytes(impl, spec).items()})
            if timed:
                row["fwd_bwd_ms"] = time_ms(impl, spec)
            rows.append(row)
    return {"rows": rows, "fits": fits(rows, seq_lens)}


def fits(rows, seq_lens) -> dict:
    """Log-log slopes over every T and over the largest three (closest to the asymptote)."""
    out = {}
    for impl in IMPLS:
        mine = [r for r in rows if r["impl"] == impl]
        for key in ("residual_bytes", "temp_bytes", "args_out_temp_bytes", "peak_memory_bytes"):
            if not all(key in r for r in mine):
                continue  # peak_memory_bytes: only where memory_analysis() reports it
            values = [r[key] for r in mine]
            out[f"{impl}.{key}"] = {
                "slope_all": round(slope(seq_lens, values), 3),
                "slope_largest3": round(slope(seq_lens[-3:], values[-3:]), 3),
            }
    return out


def print_table(result: dict, seq_lens) -> None:
    by = {(r["impl"], r["T"]): r for r in result["rows"]}
    head = "  T    " + "".join(f"| {impl + ' res/temp MiB':>28} " for impl in IMPLS)
    print(head)
    print("-" * len(head))
    for t in seq_lens:
        cells = []
        for impl in IMPLS:
            r = by[(impl, t)]
            cell = f"{r['residual_bytes'] / MB:9.2f} / {r['temp_bytes'] / MB:8.2f}"
            if "fwd_bwd_ms" in r:
                cell += f" {r['fwd_bwd_ms']:6.2f}ms"
            cells.append(f"| {cell:>28} ")
        print(f"{t:6d} " + "".join(cells))
    print("\nlog-log slope of bytes vs T (all T / largest 3 T):")
    for key, fit in result["fits"].items():
        if key.split(".")[1] in ("residual_bytes", "temp_bytes"):  # the rest: the JSON
            print(f"  {key:28s} {fit['slope_all']:6.3f} / {fit['slope_largest3']:6.3f}")


def plot(result: dict, seq_lens, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in (
        (axes[0], "residual_bytes", "saved for the backward (residuals)"),
        (axes[1], "temp_bytes", "compiled fwd+bwd temp (memory_analysis)"),
    ):
        for impl in IMPLS:
            values = [r[key] / MB for r in result["rows"] if r["impl"] == impl]
            fit = result["fits"][f"{impl}.{key}"]["slope_largest3"]
            ax.loglog(seq_lens, values, "o-", base=2, label=f"{impl} (~T^{fit:.2f} at large T)")
        ax.set_xlabel("sequence length T (= S)")
        ax.set_ylabel("MiB")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    cfg = result["config"]
    fig.suptitle(
        f"causal attention, B={cfg['batch']} H={cfg['heads']} D={cfg['head_dim']} "
        f"{cfg['dtype']} on {cfg['backend']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2**n for n in range(7, 14)])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=RESULTS / "attention_memory.json")
    args = ap.parse_args(argv)

    started = time.perf_counter()
    backend = jax.default_backend()
    seq_lens = sorted(args.seq_lens)
    result = measure(
        seq_lens, args.batch, args.heads, args.head_dim, jnp.dtype(args.dtype), backend == "gpu"
    )
    result["config"] = {
        "batch": args.batch,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "causal": True,
        "backend": backend,
        "flash": "GPU-style kernel, interpret mode" if backend == "cpu" else "compiled kernel",
        "jax": jax.__version__,
        "python": platform.python_version(),
        "timed": backend == "gpu",
    }
    result["fields"] = {
        "residual_bytes": "arrays jax.vjp keeps for the backward pass",
        "temp_bytes": "memory_analysis().temp_size_in_bytes of jit(grad(loss))",
        "args_out_temp_bytes": "arguments_bytes + outputs_bytes + temp_bytes (a plain sum)",
        "peak_memory_bytes": "memory_analysis().peak_memory_in_bytes where reported; on CPU "
        "about arguments + outputs, without the temp buffers",
    }
    write_result(args.out, result)
    plot(result, seq_lens, args.out.with_suffix(".png"))
    print_table(result, seq_lens)
    elapsed = time.perf_counter() - started
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')} ({elapsed:.1f}s)")


if __name__ == "__main__":
    main()
