"""One QLoRA train step of a SmolLM2-135M-shaped Llama on CPU: lmjax vs peft + bitsandbytes.

The parent process builds a seeded random `transformers.LlamaForCausalLM` with SmolLM2-135M's
shapes (decode.py's SMOLLM2 fields) and saves it into a temporary directory; then each side
runs in a fresh subprocess of this script (`--worker lmjax|peft`), so its peak RSS is its own:
- lmjax: `lmjax.io.hf.load`, `quantize_params` (NF4, double-quantized statistics, block 64),
  `lora.init` + `lora.objective` adapters, the jitted `make_train_step` (AdamW).
- peft: `from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit, nf4, double
  quant, compute dtype float32))` on CPU, `get_peft_model` with the same r / alpha / targets,
  eager forward + backward + `torch.optim.AdamW` step.
Both: r 8, alpha 16, all linear projections (q/k/v/o, gate/up/down), no dropout, AdamW lr 1e-4
without weight decay, the same [batch, seq_len] token batch (seeded random ids) every step, the
mean next-token NLL. The first step (lmjax: after compiling, which is timed apart) is a warm-up;
the figure is the median of the `--steps` steps after it. Peak memory (/proc VmHWM of the
worker): `peak_process` over its life (loading and quantizing included; not ru_maxrss, which
keeps the parent's peak across fork + exec) and `peak_steps` (reset just before the timed
steps: the resident base, adapters, optimizer state and the steps' activations).
Witness: the first step's loss of both sides (B = 0 so the adapters add nothing yet) agree
closely: the 4-bit codes are the same, and about 0.1% of the nested 8-bit scale codes land one
step apart (the double-quantization offset, a float32 mean, rounds one ulp differently in
torch and XLA), which moves the loss by about 6e-5 relative. The load average is recorded:
the machine may be shared.

    JAX_PLATFORMS=cpu python benchmarks/qlora_llama.py   # -> results/qlora_llama.json
    python benchmarks/qlora_llama.py --quick --output /tmp/q.json   # tiny shapes
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu is installed in the venv; CPU here

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout, no install
sys.path.insert(0, str(HERE))

from _rss import RSS_ENV, reset_peak, status_bytes  # noqa: E402

from benchmarks._harness import add_output, load_average, machine, parser, write_result  # noqa: E402

RESULTS = HERE / "results"
R, ALPHA, LR = 8, 16, 1e-4
SIDES = ("lmjax", "peft")


def token_batch(vocab: int, batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """`(inputs [b, T], targets [b, T])` int32: seeded random ids, targets the next ones."""
    ids = np.random.default_rng(0).integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
    return ids[:, :-1], ids[:, 1:]


def timed_steps(step, n: int) -> dict:
    """Run `step() -> loss` 1 + n times (the first a warm-up): losses and per-step seconds."""
    times, losses = [], []
    for _ in range(1 + n):
        start = time.perf_counter()
        losses.append(step())  # a float: waits for the step
        times.append(time.perf_counter() - start)
    return {
        "warmup_s": times[0],
        "step_s": times[1:],
        "median_step_s": statistics.median(times[1:]),
        "losses": losses,
    }


def lmjax_worker(ckpt: Path, batch: int, seq_len: int, steps: int) -> dict:
    """In this fresh process: load, quantize, adapters, compile, then the timed steps."""
    import jax
    import jax.numpy as jnp
    import optax

    from lmjax import lora
    from lmjax.io import hf as hf_io
    from lmjax.quant.params import quantize_params
    from lmjax.train.step import init_state, make_train_step

    lcfg = lora.LoraConfig(r=R, alpha=ALPHA, targets="all-linear")
    base, cfg = hf_io.load(ckpt)
    frozen = jax.block_until_ready(quantize_params(base))
    del base  # the float projections go; the embeddings and norms stay (as in bitsandbytes)
    tx = optax.adamw(LR, weight_decay=0.0)
    state = init_state(jax.random.PRNGKey(1), cfg, tx, lambda k: lora.init(k, frozen, lcfg))
    step = make_train_step(cfg, tx, lambda s: LR, loss=lora.objective(cfg, lcfg))
    inputs, targets = token_batch(cfg.vocab_size, batch, seq_len)
    b = {"inputs": jnp.asarray(inputs[None]), "targets": jnp.asarray(targets[None])}
    start = time.perf_counter()
    compiled = step.lower(state, b, frozen).compile()
    compile_s = time.perf_counter() - start
    peak_load, rss_before = reset_peak()
    holder = {"state": state}

    def one_step() -> float:
        holder["state"], metrics = compiled(holder["state"], b, frozen)
        return float(metrics["loss"])

    out = timed_steps(one_step, steps)
    adapters = sum(a.size for a in jax.tree.leaves(holder["state"].params))
    return {
        **out,
        "compile_s": compile_s,
        "trainable_params": int(adapters),
        "rss_before_steps": rss_before,
        "peak_load": peak_load,
    }


def peft_worker(ckpt: Path, batch: int, seq_len: int, steps: int) -> dict:
    """In this fresh process: bitsandbytes 4-bit load, peft adapters, the timed eager steps."""
    import peft
    import torch
    import transformers

    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = transformers.LlamaForCausalLM.from_pretrained(
        ckpt, quantization_config=quant, device_map="cpu", dtype=torch.float32
    )
    lcfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0)
    model = peft.get_peft_model(model, lcfg)
    # Training mode, as a training loop sets it. from_pretrained returns the model in eval
    # mode, where bitsandbytes (0.50, on a CPU with AVX512-BF16) repacks a Linear4bit whose
    # input needs no gradient (layer 0's q/k/v: the embedding is frozen) and multiplies it in
    # bfloat16, not in the float32 compute dtype asked for.
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    ids = token_batch(model.config.vocab_size, batch, seq_len)
    inputs, targets = (torch.from_numpy(a).long() for a in ids)
    peak_load, rss_before = reset_peak()

    def one_step() -> float:
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    out = timed_steps(one_step, steps)
    return {
        **out,
        "trainable_params": sum(p.numel() for p in trainable),
        "rss_before_steps": rss_before,
        "peak_load": peak_load,
        "torch_threads": torch.get_num_threads(),
    }


WORKERS = {"lmjax": lmjax_worker, "peft": peft_worker}


def run_worker(side: str, ckpt: Path, args) -> dict:
    """WORKERS[side] in a fresh subprocess of this script; its result plus its peak RSS."""
    sizes = ["--batch", str(args.batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    argv = [sys.executable, __file__, "--worker", side, "--checkpoint", str(ckpt), *sizes]
    env = dict(os.environ, JAX_PLATFORMS="cpu", **RSS_ENV)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"--worker {side} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def save_checkpoint(fields: dict, seed: int, out: Path) -> int:
    """The seeded random LlamaForCausalLM saved to `out`; returns its parameter count."""
    import torch
    import transformers
    from decode import INIT_RANGE

    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(**fields, initializer_range=INIT_RANGE)
    model = transformers.LlamaForCausalLM(hf_cfg)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny Llama shapes (the smoke test)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    ap.add_argument("--seed", type=int, default=0)
    add_output(ap, None, "default results/qlora_llama.json")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:  # one side, in the fresh process run_worker started
        out = WORKERS[args.worker](args.checkpoint, args.batch, args.seq_len, args.steps)
        peak_steps = status_bytes("VmHWM")
        out.update(peak_steps=peak_steps, peak_process=max(peak_steps, out["peak_load"]))
        print(json.dumps(out))
        return out
    from decode import QUICK, SMOLLM2, model_summary

    fields = QUICK if args.quick else SMOLLM2
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        n_params = save_checkpoint(fields, args.seed, Path(tmp))
        runs = {side: run_worker(side, Path(tmp), args) for side in SIDES}
    first = {side: runs[side]["losses"][0] for side in SIDES}
    result = {
        "benchmark": "one QLoRA train step on CPU, lmjax vs peft + bitsandbytes",
        "model": model_summary(args.quick, fields, n_params),
        "qlora": {
            "quant": "nf4, double quantization, block 64, compute float32",
            "r": R,
            "alpha": ALPHA,
            "targets": "all-linear (q/k/v/o, gate/up/down)",
            "optimizer": f"adamw lr {LR}, no weight decay",
        },  # fmt: skip
        "batch": args.batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "runs": runs,
        "median_step_s": {side: runs[side]["median_step_s"] for side in SIDES},
        "peak_steps_mib": {side: runs[side]["peak_steps"] / 2**20 for side in SIDES},
        "peak_process_mib": {side: runs[side]["peak_process"] / 2**20 for side in SIDES},
        "peft_over_lmjax_step_time": runs["peft"]["median_step_s"] / runs["lmjax"]["median_step_s"],
        "first_loss": first,
        "first_loss_rel_diff": abs(first["lmjax"] - first["peft"]) / abs(first["peft"]),
        "load_average": {"before": load_before, "after": load_average()},
        "machine": machine(),
    }
    out = args.output or RESULTS / ("qlora_llama_quick.json" if args.quick else "qlora_llama.json")
    write_result(out, result)
    print(json.dumps({k: result[k] for k in ("median_step_s", "peak_steps_mib",
                                             "peak_process_mib", "first_loss")}))  # fmt: skip
    print(f"wrote {out}")
    return {**result, "path": str(out)}


if __name__ == "__main__":
    main()
