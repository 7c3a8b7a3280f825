"""lm-evaluation-harness requests per second: lmjax's model ("lmjax") vs the harness's Hugging
Face backend (HFLM, CPU torch), on the same weights and tasks, in one run.

The model is a GPT-2 built offline from a seeded `GPT2Config` (`--layers`, `--width`, C 256)
with a byte-level BPE trained here (`--vocab` tokens, vocab.json + merges.txt), saved, and
imported with `lmjax import-hf`. The tasks are local jsonl files written here, one per output
type the scorer has (multiple_choice: 4 answers sharing a context; loglikelihood;
loglikelihood_rolling over texts of one to three windows), `--docs` documents each. Each side
runs `simple_evaluate` on all of them once to warm up (lmjax compiles its length buckets), then
`--repeats` timed times, the sides taking turns; the figure is requests over the median seconds
spent inside the model's own methods (the harness's task building is the same for both and
not counted). The metrics of the two are compared (`equal_results`: accuracies equal,
perplexities within 1e-4 relative): a faster wrong answer is no figure. Both sides use
`--batch-size`. generate_until is not timed (no task here asks for it).

    python benchmarks/eval_harness.py            # -> benchmarks/results/eval_harness.json
    python benchmarks/eval_harness.py --quick    # tiny, seconds (the suite's smoke test)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from benchmarks._harness import load_average, machine, parser, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = "the quick brown fox jumps over a lazy dog and sleeps in the warm sun all day".split()
METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")
CONTEXT = 256


def corpus(n: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build(root: Path, layers: int, width: int, vocab: int) -> tuple[Path, Path]:
    """`(HF directory, imported lmjax run)` of the benchmark's GPT-2."""
    from lmjax import cli

    hf = hf_gpt2(root, corpus(20000), vocab, layers, width, max(1, width // 64), CONTEXT)
    assert cli.main(["import-hf", str(hf), "--out", str(root / "run")]) == 0
    return hf, root / "run"


def hf_gpt2(
    root: Path, text: str, vocab: int, layers: int, width: int, heads: int, context: int
) -> Path:
    """root/hf: a seeded random `transformers` GPT-2 (no dropout) with a byte-level BPE of
    `vocab` tokens trained on `text` (vocab.json + merges.txt; <|endoftext|> its bos and eos).
    tests/test_eval_harness.py builds its GPT-2 witness here too."""
    import torch
    import transformers

    from lmjax.tokenizers import BPETokenizer

    tok = BPETokenizer.train([text], vocab)
    tok.save(root / "tok")
    hf = root / "hf"
    hf.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(root / "tok" / name, hf / name)
    eot = tok.special_tokens["<|endoftext|>"]
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=tok.vocab_size, n_positions=context, n_embd=width, n_layer=layers,
        n_head=heads, bos_token_id=eot, eos_token_id=eot, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(hf)
    return hf


def write_tasks(directory: Path, docs: int) -> list[str]:
    """Local jsonl tasks, one per loglikelihood output type; their names."""
    import random

    rng = random.Random(1)
    data = directory / "docs.jsonl"
    rows = []
    for i in range(docs):
        words = [rng.choice(WORDS) for _ in range(30)]
        text = corpus(60 + 120 * (i % 4), seed=i)
        rows.append({"q": " ".join(words[: 10 + i % 20]), "a": " " + words[-1], "text": text,
                     "choices": [" " + w for w in words[-4:]], "gold": i % 4})  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bodies = {
        "bench_mc": ("multiple_choice", "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\n"
                     "doc_to_text: '{{q}}'\nmetric_list: [{metric: acc}, {metric: acc_norm}]"),
        "bench_ll": ("loglikelihood", "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
                     "metric_list: [{metric: perplexity}, {metric: acc}]"),
        "bench_roll": ("loglikelihood_rolling", "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                       "metric_list: [{metric: word_perplexity}]"),
    }  # fmt: skip
    for name, (kind, body) in bodies.items():
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files: {{test: '{data}'}}"
            f"\n  cache_dir: '{directory / 'cache'}'\ntest_split: test\noutput_type: {kind}\n"
            f"{body}\n"
        )
    return list(bodies)


class Clock:
    """Seconds and requests inside an LM's request methods (wrapped on the instance)."""

    def __init__(self, lm):
        self.seconds, self.requests = 0.0, 0
        for name in METHODS:
            setattr(lm, name, self._wrap(getattr(lm, name)))

    def _wrap(self, method):
        def timed(requests, *args, **kwargs):
            start = time.perf_counter()
            out = method(requests, *args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.requests += len(requests)
            return out

        return timed


def metrics(results: dict) -> dict:
    return {
        f"{task}/{key}": value
        for task, row in results["results"].items()
        for key, value in row.items()
        if "," in key and "stderr" not in key and isinstance(value, float)
    }


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="a tiny model and 8 documents")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", type=Path, default=None, help="default: results/eval_harness.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.vocab, args.docs, args.repeats = 1, 64, 300, 8, 1
    name = "eval_harness_quick.json" if args.quick else "eval_harness.json"
    out = args.output or RESULTS / name
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(HF_HOME=f"{tmp}/hf_home", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        result = run(Path(tmp), args)
    write_result(out, result)
    print(json.dumps(result["per_second"]), f"lmjax/hf {result['speedup']:.2f}x -> {out}")
    return {"path": str(out), **result}


def run(root: Path, args) -> dict:
    import jax
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from lmjax.eval_harness import LMJaxLM

    load_before = load_average()
    hf, run_dir = build(root, args.layers, args.width, args.vocab)
    (root / "tasks").mkdir()
    names = write_tasks(root / "tasks", args.docs)
    manager = TaskManager(include_path=str(root / "tasks"), include_defaults=False)
    sides = {
        "lmjax": LMJaxLM(run=str(run_dir), batch_size=args.batch_size),
        "hf": HFLM(pretrained=str(hf), device="cpu", dtype="float32", batch_size=args.batch_size),
    }
    options = dict(tasks=names, task_manager=manager, log_samples=False, bootstrap_iters=0)
    found = {name: metrics(simple_evaluate(model=lm, **options)) for name, lm in sides.items()}
    seconds = {name: [] for name in sides}
    requests = 0
    for _ in range(args.repeats):
        for name, lm in sides.items():
            clock = Clock(lm)
            simple_evaluate(model=lm, **options)
            seconds[name].append(clock.seconds)
            requests = clock.requests
            for method in METHODS:  # unwrap for the next round
                vars(lm).pop(method, None)
    median = {name: sorted(s)[len(s) // 2] for name, s in seconds.items()}
    equal = all(
        abs(found["lmjax"][k] - v) <= 1e-4 * max(1.0, abs(v)) for k, v in found["hf"].items()
    )
    return {
        "title": "lm-evaluation-harness requests/s, lmjax vs HFLM (CPU torch)",
        "model": {"layers": args.layers, "width": args.width, "vocab": args.vocab,
                  "context": CONTEXT},
        "tasks": names, "docs_per_task": args.docs, "requests": requests,
        "batch_size": args.batch_size, "repeats": args.repeats, "seconds": seconds,
        "per_second": {name: requests / m for name, m in median.items()},
        "speedup": median["hf"] / median["lmjax"], "equal_results": equal, "metrics": found,
        "device": str(jax.devices()[0].device_kind), "torch_threads": torch.get_num_threads(),
        "quick": args.quick,
        "machine": machine(load_before=load_before, load_after=load_average()),
    }  # fmt: skip


if __name__ == "__main__":
    main()
