"""The `lmjax` command line: thin parsing around library calls, one-line errors.

Subcommands so far: `gradcheck` (every primitive's hand-written VJP against `jax.grad` of its
reference and against float64 finite differences) and `inspect` (a preset's parameter table,
count and memory estimate). Training, generation and interop commands of SPEC section 10
arrive with their issues.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time

from lmjax.errors import LMJaxError


def _gradcheck(args: argparse.Namespace) -> int:
    import jax

    from lmjax import testing

    cases = [c for c in testing.OP_CASES if fnmatch.fnmatchcase(c.name, args.ops)]
    if not cases:
        names = ", ".join(c.name for c in testing.OP_CASES)
        raise LMJaxError(
            f"--ops = {args.ops!r} matches no op case; expected a glob over: "
            f"{names}. Fix: e.g. --ops 'attention*'."
        )
    header = f"{'op case':34} {'|value diff|':>12} {'|grad diff|':>12} {'FD rel err':>11}  ok"
    print("custom VJP vs jax.grad(reference) in float32, and vs finite differences in float64")
    print(header)
    print("-" * len(header))
    failures, start = 0, time.perf_counter()
    for case in cases:
        report = testing.compare_with_reference(case, args.seed, transform=jax.jit)
        fd = testing.finite_difference_error(case, args.seed)
        ok = report.ok and fd <= testing.FD_RTOL
        failures += not ok
        print(
            f"{case.name:34} {report.value_error:12.2e} {report.grad_error:12.2e} "
            f"{fd:11.2e}  {'yes' if ok else 'NO'}",
            flush=True,
        )
    print(
        f"{len(cases) - failures}/{len(cases)} op cases agree "
        f"(float32 rtol {testing.F32_RTOL:g}, finite-difference rtol {testing.FD_RTOL:g}) "
        f"in {time.perf_counter() - start:.1f}s"
    )
    return 1 if failures else 0


def _inspect(args: argparse.Namespace) -> int:
    from lmjax import models
    from lmjax.config import parse_overrides

    cfg = models.preset(args.preset, **parse_overrides(args.overrides))
    for name, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise LMJaxError(f"{name} = {value}; expected an int >= 1. Fix: pass e.g. {name} 8.")
    if args.seq_len is not None and args.seq_len > cfg.context_length:
        raise LMJaxError(
            f"--seq-len = {args.seq_len}; expected <= context_length = {cfg.context_length}. "
            "Fix: lower --seq-len or override context_length."
        )
    print(f"{args.preset}: " + ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items()))
    print(models.format_summary(cfg, args.batch_size, args.seq_len))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmjax",
        description="lmjax: decoder-only transformer LMs in JAX, from the command line.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    grad = sub.add_parser(
        "gradcheck",
        help="check every primitive's hand-written VJP against jax.grad and finite differences",
        description="Compare each op's custom VJP with jax.grad of its plain-jnp reference "
        "(float32) and with centered finite differences (float64). Exits 1 if any disagrees.",
    )
    grad.add_argument("--ops", default="*", help="glob over op-case names (default: all)")
    grad.add_argument("--seed", type=int, default=0, help="PRNG seed for the inputs")
    grad.set_defaults(run=_gradcheck)
    from lmjax.models.config import PRESETS

    insp = sub.add_parser(
        "inspect",
        help="print a model's parameter table, total count and memory estimate",
        description="Print every parameter (name, shape, count) of a preset with optional "
        "key=value overrides, the total, and a memory estimate for the parameters, gradients, "
        "AdamW state and the activations the backward pass keeps (traced, nothing is "
        "allocated).",
    )
    insp.add_argument("preset", help=f"one of: {', '.join(PRESETS)}")
    insp.add_argument("overrides", nargs="*", help="model fields, e.g. n_layers=4 dtype=bfloat16")
    insp.add_argument("--batch-size", type=int, default=1, help="batch for the activation estimate")
    insp.add_argument(
        "--seq-len", type=int, default=None, help="sequence length (default: context_length)"
    )
    insp.set_defaults(run=_inspect)
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse, letting `key=value` overrides sit anywhere, also after options."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    unknown = [item for item in extra if item not in overrides]
    if unknown or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        return args.run(args)
    except LMJaxError as err:
        print(f"lmjax {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
