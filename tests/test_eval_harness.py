"""lmjax as an lm-evaluation-harness model (issue 46) against the harness's own Hugging Face
backend (`HFLM`) on the same weights, offline.

Two witnesses, built here with `transformers` and imported with `lmjax import-hf`: a tiny GPT-2
(C = 64) with a byte-level BPE trained here (vocab.json + merges.txt, <|endoftext|> its bos and
eos), and tests/_llama_run.py's tiny GQA Llama (C = 128) with its ChatML tokenizer.json, chat
template and generation_config.json. For each, every request's log-likelihood and is_greedy
equal HFLM's, over the traps: an empty context, a context longer than the model (cut from the
left), a context ending in a space, a token spanning the context/continuation boundary,
answers sharing a context (one row) or extending each other; rolling log-likelihoods over
several windows; and `generate_until` texts with stop strings. Then `simple_evaluate` on local
jsonl tasks of each output type gives HFLM's metrics.

Tolerance: both sides compute in float32, in different orders. A log-probability is a logit
minus a logsumexp of logits, each within `testing.logits_atol` (a derived float32 bound on the
forward pass's rounding, scaled by the largest logit) of exact, so one token's log-probability
is within 2 x that and a continuation of n tokens within 2n x that. is_greedy compares an
argmax, so it must be equal outright (the random witnesses have no logit ties within the bound:
if one had, the test would say which request).
"""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import _llama_run  # noqa: E402
from _benchmarks import load_benchmark  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from lmjax import cli, testing  # noqa: E402

GPT2_C = 64
WORDS = "the quick brown fox jumps over a lazy dog and sleeps in sun".split()
CORPUS = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(3000))  # BPE training text


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """Nothing downloads: the hub offline, its cache in a temporary directory."""
    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {
            "HF_HOME": str(home),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }.items():
            mp.setenv(key, value)  # fmt: skip
        yield


def _gpt2_dir(root):
    """A random tiny GPT-2 with its own BPE (vocab.json + merges.txt) in root/hf."""
    bench = load_benchmark("eval_harness")
    return bench.hf_gpt2(root, CORPUS, 300, layers=2, width=32, heads=4, context=GPT2_C)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def witness(request, tmp_path_factory):
    """`(HF directory, imported run, HFLM, LMJaxLM)` of one witness."""
    from lm_eval.models.huggingface import HFLM

    from lmjax.eval_harness import LMJaxLM

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        hf = _gpt2_dir(root)
    else:
        hf = root / "hf"
        _llama_run.hf_checkpoint(hf, chat=True)
    assert cli.main(["import-hf", str(hf), "--out", str(root / "run")]) == 0
    theirs = HFLM(pretrained=str(hf), device="cpu", dtype="float32", batch_size=4)
    ours = LMJaxLM(run=str(root / "run"), batch_size=4)
    return request.param, hf, theirs, ours


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _atol(lm) -> float:
    """`testing.logits_atol` of the witness's logits over a full context of real text."""
    from lmjax.models import forward

    cfg = lm.run.model
    ids = lm.tok_encode(" ".join(WORDS * 20))[: cfg.context_length]
    return testing.logits_atol(cfg, np.asarray(forward(lm.run.params, np.asarray([ids]), cfg))[0])


def _long(n_words: int) -> str:
    return " ".join(WORDS[(3 * i) % len(WORDS)] for i in range(n_words))


LOGLIKELIHOOD = [
    ("", "the quick fox"),  # empty context: the prefix token stands for it
    ("", "jumps"),
    ("the lazy dog ", "sleeps in sun"),  # a context ending in a space
    ("the qui", "ck brown fox"),  # "quick" spans the boundary
    ("a lazy", " dog"),  # answers sharing a context (one-token answers share a row)
    ("a lazy", " fox"),
    ("a lazy", " sun"),
    ("a lazy", " dog and"),  # extends " dog"
    ("over", " the"),
    (_long(150), " fox jumps"),  # longer than either model: cut from the left
    (_long(40), _long(50)),  # context and continuation each long, together past C
]


def test_loglikelihood_equals_hflm(witness):
    name, _, theirs, ours = witness
    requests = _requests("loglikelihood", LOGLIKELIHOOD)
    want = theirs.loglikelihood(requests, disable_tqdm=True)
    got = ours.loglikelihood(requests, disable_tqdm=True)
    atol = _atol(ours)
    for (ctx, cont), (w_logp, w_greedy), (g_logp, g_greedy) in zip(
        LOGLIKELIHOOD, want, got, strict=True
    ):
        n = len(ours._encode_pair(ctx, cont)[1]) if ctx else len(ours.tok_encode(cont))
        assert abs(g_logp - w_logp) <= 2 * n * atol, (name, ctx[:20], cont[:20], g_logp, w_logp)
        assert g_greedy == w_greedy, (name, ctx[:20], cont[:20])


FINETUNE = """finetune: {{base: {base}}}
lora: {{r: 4, alpha: 8, targets: [all-linear], dropout: 0.0}}
data: {{corpus: {corpus}}}
optimizer: {{name: adamw, lr: 0.05, weight_decay: 0.0}}
schedule: {{warmup_steps: 1}}
train: {{steps: 3, batch_size: 2, seq_len: 32, eval_every: 3, eval_batches: 1}}
checkpoint: {{every: 3, keep: 1}}
logging: {{every: 1, progress: false, sample_tokens: 0, plot: false}}
"""


def _fine_tune(base, tmp_path, qlora: bool):
    """tmp_path/ft: 3 LoRA (or QLoRA) steps over the witness `base` on CORPUS."""
    (tmp_path / "corpus.txt").write_text(CORPUS)
    config = FINETUNE.format(base=base.run.directory, corpus=tmp_path / "corpus.txt")
    (tmp_path / "ft.yaml").write_text(config.replace("{base:", "{qlora: true, base:") if qlora
                                      else config)  # fmt: skip
    assert cli.main(["finetune", str(tmp_path / "ft.yaml"), f"run.dir={tmp_path / 'ft'}"]) == 0
    return tmp_path / "ft"


@pytest.mark.parametrize("witness", ["gpt2"], indirect=True)  # one fine-tune is enough
def test_a_lora_fine_tune_scores_as_hflm_on_its_export(witness, tmp_path):
    """A LoRA run (adapters beside a frozen base, merged when loaded, as `lmjax generate`
    loads it) scores as HFLM on its `export-hf` copy, and not as its base. (Both sides merge
    with lmjax's code; the merge itself is held against peft in tests/test_lora.py.)"""
    from lm_eval.models.huggingface import HFLM

    from lmjax.eval_harness import LMJaxLM

    name, _, _, base = witness
    run, hf = _fine_tune(base, tmp_path, qlora=False), tmp_path / "ft_hf"
    assert cli.main(["export-hf", str(run), "--out", str(hf)]) == 0
    theirs = HFLM(pretrained=str(hf), device="cpu", dtype="float32", batch_size=4)
    ours = LMJaxLM(run=str(run), batch_size=4)
    requests = _requests("loglikelihood", LOGLIKELIHOOD)
    want = theirs.loglikelihood(requests, disable_tqdm=True)
    got = ours.loglikelihood(requests, disable_tqdm=True)
    before = base.loglikelihood(requests, disable_tqdm=True)
    atol = _atol(ours)
    moved = 0
    for (ctx, cont), w, g, b in zip(LOGLIKELIHOOD, want, got, before, strict=True):
        bound = 2 * len(ours._encode_pair(ctx, cont)[1] if ctx else ours.tok_encode(cont)) * atol
        assert abs(g[0] - w[0]) <= bound and g[1] == w[1], (ctx[:20], cont[:20], g, w)
        moved += abs(g[0] - b[0]) > 2 * bound
    assert moved >= len(LOGLIKELIHOOD) // 2  # the adapters are applied


@pytest.mark.parametrize("witness", ["gpt2"], indirect=True)  # one fine-tune is enough
def test_a_qlora_run_scores_from_its_nf4_base(witness, tmp_path):
    """A QLoRA run scores from its NF4 base with the adapters attached (what `lmjax generate`
    decodes from): each request's log-likelihood is the one read off `models.forward` of those
    weights on the request's whole row; `quantize=none` (the merged dequantized weights, the
    same function) agrees, and the float base it was quantized from does not."""
    from lmjax.eval_harness import LMJaxLM
    from lmjax.models import forward
    from lmjax.train.runs import is_qlora, load_run

    name, _, _, base = witness
    run = _fine_tune(base, tmp_path, qlora=True)
    assert is_qlora(run)
    nf4, merged = LMJaxLM(run=str(run), batch_size=4), LMJaxLM(run=str(run), quantize="none")
    loaded = load_run(run, quantize="nf4")
    pairs = [
        nf4._encode_pair(c, t) if c else ([nf4.prefix_token_id], nf4.tok_encode(t))
        for c, t in LOGLIKELIHOOD[:9]
    ]  # fmt: skip  (all within C)
    requests = [((None, None), c, t) for c, t in pairs]
    scores = [lm._loglikelihood_tokens(requests, disable_tqdm=True) for lm in (nf4, merged, base)]
    atol, moved = _atol(nf4), 0
    for (ctx, cont), *found in zip(pairs, *scores, strict=True):
        row = np.asarray([[*ctx, *cont][:-1]])
        logits = np.asarray(forward(loaded.params, row, loaded.model), np.float64)[0]
        logits = logits[len(ctx) - 1 :, : loaded.model.vocab_ids]
        top = logits.max(-1)
        logz = np.log(np.exp(logits - top[:, None]).sum(-1)) + top
        want = float(sum(logits[i, t] - logz[i] for i, t in enumerate(cont)))
        (ours, _), (dense, _), (float_base, _) = found
        bound = 2 * len(cont) * atol
        assert abs(ours - want) <= bound and abs(dense - want) <= bound, (ctx, cont, want)
        moved += abs(float_base - want) > 2 * bound
    assert moved >= len(pairs) // 2  # the NF4 base and adapters, not the float base


def test_greedy_continuations_are_greedy_as_in_hflm(witness):
    """Token-level requests whose continuation is HF's own greedy one (is_greedy True on both
    sides), and the same with its last token changed (False on both)."""
    name, _, theirs, ours = witness
    requests = []
    for i, text in enumerate(["the quick", "a lazy dog", _long(100)]):
        ctx = ours.tok_encode(text)[-40:]
        with torch.no_grad():
            out = theirs.model.generate(
                torch.tensor([ctx]), max_new_tokens=3, do_sample=False, pad_token_id=0
            )[0, len(ctx) :].tolist()
        requests.append(((None, None), ctx, out))
        requests.append(((None, None), ctx, [*out[:-1], (out[-1] + 1 + i) % 250]))
    want = theirs._loglikelihood_tokens(requests, disable_tqdm=True)
    got = ours._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [g for _, g in want] == [True, False] * 3
    assert [g for _, g in got] == [g for _, g in want]
    atol = _atol(ours)
    np.testing.assert_allclose([lp for lp, _ in got], [lp for lp, _ in want], atol=6 * atol, rtol=0)


def test_rolling_loglikelihood_over_several_windows_equals_hflm(witness):
    name, _, theirs, ours = witness
    texts = [_long(400), "the quick brown fox", _long(130)]
    c = ours.max_length
    assert len(ours.tok_encode(texts[0])) > 3 * c  # several windows
    requests = _requests("loglikelihood_rolling", [(t,) for t in texts])
    want = theirs.loglikelihood_rolling(requests, disable_tqdm=True)
    got = ours.loglikelihood_rolling(requests, disable_tqdm=True)
    atol = _atol(ours)
    for text, w, g in zip(texts, want, got, strict=True):
        assert abs(g - w) <= 2 * len(ours.tok_encode(text)) * atol, (name, text[:20], g, w)


def test_generate_until_with_stop_strings_equals_hflm(witness):
    """Stop strings cut inside HF's own greedy text (found by a first run without them), one
    spanning two tokens; a context longer than C - max_gen_toks is cut from the left."""
    name, _, theirs, ours = witness
    # (No empty context: HFLM generates from a row of padding there; lmjax from the prefix.)
    contexts = ["the quick", "a lazy dog sleeps", _long(200), "over the"]
    free = {"until": ["NEVER"], "max_gen_toks": 12, "do_sample": False}
    plain = theirs.generate_until(_requests("generate_until", [(c, free) for c in contexts]),
                                  disable_tqdm=True)  # fmt: skip
    assert (
        ours.generate_until(
            _requests("generate_until", [(c, free) for c in contexts]), disable_tqdm=True
        )
        == plain
    )
    stops = [text[len(text) // 2 : len(text) // 2 + 3] or "x" for text in plain]
    args = [(c, {"until": [s], "max_gen_toks": 12}) for c, s in zip(contexts, stops, strict=True)]
    want = theirs.generate_until(_requests("generate_until", args), disable_tqdm=True)
    got = ours.generate_until(_requests("generate_until", args), disable_tqdm=True)
    assert got == want
    assert sum(len(w) < len(p) for w, p in zip(want, plain, strict=True)) >= 2  # stops cut


# ---- whole tasks: simple_evaluate on local jsonl tasks, and lmjax eval --tasks -----------------

TASKS = {
    "tiny_mc": ("multiple_choice", "doc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
                "doc_to_target: '{{gold}}'\nmetric_list: [{metric: acc}, {metric: acc_norm}]"),
    "tiny_ll": ("loglikelihood", "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
                "metric_list: [{metric: perplexity}, {metric: acc}]"),
    "tiny_roll": ("loglikelihood_rolling", "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                  "metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, "
                  "{metric: bits_per_byte}]"),
    "tiny_gen": ("generate_until", "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
                 "generation_kwargs: {until: ['.', ' sun'], max_gen_toks: 6, do_sample: false}\n"
                 "metric_list: [{metric: exact_match}]"),
}  # fmt: skip


def _docs(i: int) -> dict:
    words = [WORDS[(i * 5 + k) % len(WORDS)] for k in range(6)]
    return {
        "q": " ".join(words[:4]), "a": " " + words[4], "choices": [" " + w for w in words[3:]],
        "gold": i % 3, "text": _long(20 + 40 * (i % 4)),
    }  # fmt: skip


def write_tasks(directory, data_dir=None) -> None:
    """TASKS as YAMLs in `directory` over one local jsonl file of 8 documents (`data_dir`:
    the datasets cache, under `directory` by default)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(_docs(i)) + "\n" for i in range(8)))
    cache = data_dir or directory / "datasets"
    for name, (kind, body) in TASKS.items():
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files: {{test: '{data}'}}\n"
            f"  cache_dir: '{cache}'\ntest_split: test\noutput_type: {kind}\n{body}\n"
        )


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tasks")
    write_tasks(directory)
    return directory


def _metrics(results: dict) -> dict:
    return {
        (task, key): value
        for task, row in results["results"].items()
        for key, value in row.items()
        if "," in key and "stderr" not in key and isinstance(value, float)
    }


def _metric_bounds(ours, atol: float) -> dict[str, tuple[float, float]]:
    """`task -> (relative, absolute)` bounds on a metric's difference from HFLM's, from the
    request bound (`_atol`): a document's log-likelihood of n tokens is within e = 2 n atol, so
    a mean or a per-word or per-byte one (at least one word or byte a document) is within the
    task's largest e, a perplexity (exp of minus that) within a relative expm1(e), and
    bits_per_byte within e / ln 2. Accuracies and exact match count decisions: equal."""
    docs = [_docs(i) for i in range(8)]
    tokens = {
        "tiny_ll": max(len(ours._encode_pair(d["q"], d["a"])[1]) for d in docs),
        "tiny_roll": max(len(ours.tok_encode(d["text"])) for d in docs),
    }
    return {task: 2 * n * atol for task, n in tokens.items()}


def _assert_metrics_close(got: dict, want: dict, bounds: dict, name: str) -> None:
    assert set(got) == set(want), name
    for (task, key), value in want.items():
        metric, e = key.split(",")[0], bounds.get(task, 0.0)
        if metric == "bits_per_byte":
            assert abs(got[task, key] - value) <= e / np.log(2), (name, task, key)
        elif "perplexity" in metric:
            assert got[task, key] == pytest.approx(value, rel=np.expm1(e), abs=0), (name, key)
        else:  # a count of equal decisions
            assert got[task, key] == value, (name, task, key)


def test_simple_evaluate_gives_hflms_metrics_for_each_output_type(witness, task_dir):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    name, _, theirs, ours = witness
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    run = dict(tasks=list(TASKS), task_manager=manager, log_samples=False, bootstrap_iters=0)
    want = _metrics(simple_evaluate(model=theirs, **run))
    got = _metrics(simple_evaluate(model=ours, **run))
    assert {task for task, _ in want} == set(TASKS) and len(want) >= 8
    _assert_metrics_close(got, want, _metric_bounds(ours, _atol(ours)), name)


# The GPT-2 witness has no chat template.
@pytest.mark.parametrize("witness", ["llama"], indirect=True)
def test_chat_template_renders_as_hflm(witness):
    """`apply_chat_template` is HFLM's text for a system, user and assistant history, with a
    generation prompt and with the last message left open (continue_final_message)."""
    name, _, theirs, ours = witness
    history = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "jumps over "},
    ]
    assert ours.chat_template(True) == theirs.chat_template(True) is not None
    assert ours.chat_template(False) is None
    cases = ((history[:2], True), (history, False), (history[1:], False))
    seen = [_both_render(theirs, ours, *case) for case in cases]
    assert seen[1].endswith("jumps over ") and "Answer briefly" in seen[1]  # spaces kept
    # A template that strips contents and refuses a system role: the open message's trailing
    # space goes, and the system message is dropped (HFLM's retry).
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    kept = theirs.tokenizer.chat_template, ours.tokenizer.chat_template
    try:
        theirs.tokenizer.chat_template = ours.tokenizer.chat_template = strict
        seen = [_both_render(theirs, ours, *case) for case in cases]
    finally:
        theirs.tokenizer.chat_template, ours.tokenizer.chat_template = kept
    assert seen[1].endswith("jumps over") and "Answer briefly" not in seen[1]


def _both_render(theirs, ours, messages, prompt: bool) -> str:
    want = theirs.apply_chat_template(messages, add_generation_prompt=prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == want, prompt
    return want


# The GPT-2 witness has no chat template.
@pytest.mark.parametrize("witness", ["llama"], indirect=True)
def test_simple_evaluate_with_the_chat_template_gives_hflms_metrics(witness, task_dir):
    """The harness's chat-formatted requests (apply_chat_template, one few-shot example as
    turns of the conversation) score as HFLM's."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    name, _, theirs, ours = witness
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    run = dict(tasks=["tiny_mc", "tiny_ll", "tiny_gen"], task_manager=manager, num_fewshot=1,
               apply_chat_template=True, fewshot_as_multiturn=True, bootstrap_iters=0)  # fmt: skip
    want = simple_evaluate(model=theirs, log_samples=False, **run)
    got = simple_evaluate(model=ours, log_samples=True, **run)
    context = got["samples"]["tiny_gen"][0]["arguments"][0][0]
    assert context.count("<|im_start|>user") == 2 and context.endswith("<|im_start|>assistant\n")
    _assert_metrics_close(_metrics(got), _metrics(want), _metric_bounds(ours, _atol(ours)), name)


def test_a_task_compiles_one_program_per_length_bucket(witness):
    """Requests of every length run in fixed shapes: one program per length bucket used (a
    batch size no other test uses, so none is cached yet); one-token answers to one context
    share a row."""
    from lmjax.eval_harness import scoring

    name, _, _, ours = witness
    cfg = ours.run.model
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, cfg.context_length + 30, 50)
    requests = [
        (
            rng.integers(0, 200, int(n)).tolist(),
            rng.integers(0, 200, int(rng.integers(1, 4))).tolist(),
        )
        for n in lengths
    ]
    sizes = scoring.buckets(cfg.context_length)
    used = {min(b for b in sizes if b >= len(scoring.input_row(*r, cfg.context_length)))
            for r in requests}  # fmt: skip
    before = scoring.compiled_programs()
    out = scoring.run(ours._params, cfg, requests, batch_size=3)
    assert scoring.compiled_programs() - before == len(used) >= 3, name
    assert len(out) == len(requests) and all(lp < 0 for lp, _ in out)
    shared = scoring.plan([([5, 6, 7], [t]) for t in (1, 2, 3, 4)], cfg.context_length)
    assert len(shared.rows) == 1


DATA_PARALLEL = """
import json, jax, numpy as np
from lmjax import models, testing
from lmjax.eval_harness import scoring
cfg = models.preset("gpt", vocab_size=97, context_length=64, d_model=32, n_heads=4, n_layers=2,
                    d_ff=64)
params = models.init(jax.random.PRNGKey(0), cfg)
rng = np.random.default_rng(0)
requests = [(rng.integers(0, 97, int(n)).tolist(), rng.integers(0, 97, int(k)).tolist())
            for n, k in zip(rng.integers(1, 90, 30), rng.integers(1, 4, 30))]
mesh = scoring.data_mesh()
one = scoring.run(scoring.scoring_params(params, cfg), cfg, requests, batch_size=3)
many = scoring.run(scoring.scoring_params(params, cfg, mesh), cfg, requests, batch_size=3,
                   mesh=mesh)
logits = models.forward(params, np.asarray([requests[0][0][:64] * 64])[:, :64], cfg)
print(json.dumps({"devices": jax.device_count(), "rows": scoring.batch_rows(3, mesh),
                  "one": one, "many": many, "lengths": [len(c) for _, c in requests],
                  "atol": testing.logits_atol(cfg, np.asarray(logits)[0])}))
"""


def test_several_devices_split_the_batch_and_score_the_same():
    """On 4 simulated CPU devices (a subprocess: the count is fixed when jax starts) the batch
    is split over all of them (3 rows rounded up to 4) and every request scores as on one
    device, within the request bound (the rows' matmuls are blocked differently)."""
    import os
    import subprocess

    from _xla_flags import host_devices

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": host_devices(4)}
    done = subprocess.run([sys.executable, "-c", DATA_PARALLEL], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4 and result["rows"] == 4
    for n, (a, a_greedy), (b, b_greedy) in zip(
        result["lengths"], result["one"], result["many"], strict=True
    ):
        assert abs(a - b) <= 2 * n * result["atol"] and a_greedy == b_greedy, (n, a, b)


@pytest.mark.parametrize("witness", ["gpt2"], indirect=True)  # the command line once is enough
def test_lmjax_eval_tasks_prints_the_table_and_writes_json(witness, task_dir, tmp_path, capsys):
    name, _, _, ours = witness
    run, out = str(ours.run.directory), tmp_path / "res" / "out.json"
    argv = ["eval", run, "--tasks", "tiny_mc,tiny_gen", "--include-path", str(task_dir),
            "--limit", "4", "--batch-size", "4", "--output", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    results = written["results"]
    assert set(results) == {"tiny_mc", "tiny_gen"} and 0 <= results["tiny_mc"]["acc,none"] <= 1
    assert written["n-samples"]["tiny_mc"] == {"original": 8, "effective": 4}  # --limit
    # The harness's table (make_table: | task | version | filter | n-shot | metric | | value |)
    # shows the numbers in the JSON, to its 4 significant digits.
    rows = [[c.strip() for c in line.split("|")] for line in printed.splitlines() if "|" in line]
    firsts = {row[1]: row for row in rows if row[1] in results}
    assert set(firsts) == set(results), printed
    for task, row in firsts.items():
        assert float(row[7]) == pytest.approx(results[task][f"{row[5]},none"], rel=1e-3), row


@pytest.mark.parametrize("witness", ["gpt2"], indirect=True)  # the command line once is enough
@pytest.mark.slow  # lm_eval's command line indexes its own ~15,000 tasks: 5 s alone, 15 s loaded
def test_lm_evals_own_command_line_finds_the_model(witness, task_dir, tmp_path, monkeypatch):
    """`python -m lmjax.eval_harness ...` is `lm_eval ...` with "lmjax" registered."""
    import runpy

    name, _, _, ours = witness
    out = tmp_path / "lm_eval_out"
    argv = ["lm_eval", "run", "--model", "lmjax", "--model_args", f"run={ours.run.directory}",
            "--batch_size", "4", "--tasks", "tiny_mc", "--include_path", str(task_dir),
            "--limit", "4", "--output_path", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_module("lmjax.eval_harness", run_name="__main__")
    (written,) = out.rglob("results_*.json")
    result = json.loads(written.read_text())
    assert result["config"]["model"] == "lmjax"
    assert 0 <= result["results"]["tiny_mc"]["acc,none"] <= 1


def _one_error_line(argv, capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("witness", ["gpt2"], indirect=True)  # the command line once is enough
def test_lmjax_eval_tasks_errors_are_one_line(witness, tmp_path, capsys):
    name, _, _, ours = witness
    run = str(ours.run.directory)
    line = _one_error_line(["eval", str(tmp_path / "nowhere"), "--tasks", "arc_easy"], capsys)
    assert "run path" in line and "nowhere" in line  # before any task is looked up
    line = _one_error_line(["eval", run, "--num-fewshot", "2"], capsys)
    assert "--num-fewshot" in line and "--tasks" in line
    line = _one_error_line(["eval", run, "--tasks", "tiny_mc", "--batches", "2"], capsys)
    assert "--batches" in line and "--tasks" in line
    line = _one_error_line(["eval", run, "--tasks", " , "], capsys)
    assert "--tasks" in line


@pytest.mark.parametrize("witness", ["gpt2"], indirect=True)  # the command line once is enough
@pytest.mark.slow  # indexing lm_eval's own ~15,000 task names: 6 s alone, 15-25 s under load
def test_unknown_and_hub_only_tasks_are_one_line(witness, task_dir, capsys):
    name, _, _, ours = witness
    run = str(ours.run.directory)
    line = _one_error_line(["eval", run, "--tasks", "tiny_mx", "--include-path", str(task_dir)],
                           capsys)  # fmt: skip
    assert "tiny_mx" in line and "tiny_mc" in line  # the nearest names
    # A harness task of its own whose data is on the hub, offline with an empty HF_HOME.
    line = _one_error_line(["eval", run, "--tasks", "arc_easy", "--limit", "2"], capsys)
    assert "arc_easy" in line and "Hugging Face cache" in line and "ai2_arc" in line


@pytest.mark.parametrize("witness", ["gpt2"], indirect=True)  # the command line once is enough
def test_without_lm_eval_tasks_name_the_install_and_eval_stays_the_loss(
    witness, tmp_path, capsys, monkeypatch
):
    """lm_eval not importable (None in sys.modules, as if not installed): --tasks is one line
    naming the install; eval without --tasks prints the validation loss as before."""
    import yaml

    name, _, _, ours = witness
    run = tmp_path / "run"
    shutil.copytree(ours.run.directory, run)
    (tmp_path / "corpus.txt").write_text(CORPUS)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"]["corpus"] = str(tmp_path / "corpus.txt")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    harness = ("lm_eval.", "lmjax.eval_harness")
    for module in ["lm_eval", *[m for m in sys.modules if m.startswith(harness)]]:
        monkeypatch.setitem(sys.modules, module, None)
    line = _one_error_line(["eval", str(run), "--tasks", "tiny_mc"], capsys)
    assert "pip install 'lmjax[eval]'" in line
    argv = ["eval", str(run), "--batches", "1", "--batch-size", "2", "--seq-len", "16"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "validation loss" in capsys.readouterr().out


def test_quick_benchmark_writes_both_sides_rates_and_equal_results(tmp_path, monkeypatch):
    """benchmarks/eval_harness.py --quick: one JSON with each side's requests per second over
    the same requests, their ratio, and the metrics of both, equal."""
    import os

    for key in ("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # main sets them: restore
        monkeypatch.setenv(key, os.environ.get(key, ""))
    out = tmp_path / "eval_harness.json"
    result = load_benchmark("eval_harness").main(["--quick", "--output", str(out)])
    data = json.loads(out.read_text())
    assert result["path"] == str(out) and data["equal_results"] and data["quick"]
    assert data["requests"] == 8 * 4 + 8 + 8  # 4 choices, 1 answer, 1 text a document
    median = {side: sorted(s)[len(s) // 2] for side, s in data["seconds"].items()}
    for side in ("lmjax", "hf"):
        assert data["per_second"][side] == pytest.approx(data["requests"] / median[side])
    assert data["speedup"] == pytest.approx(median["hf"] / median["lmjax"])
    assert data["metrics"]["lmjax"].keys() == data["metrics"]["hf"].keys()
    assert len(data["metrics"]["hf"]) == 5
