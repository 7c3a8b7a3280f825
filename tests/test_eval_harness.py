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

import shutil

import numpy as np
import pytest

pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import _llama_run  # noqa: E402
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
    from lmjax.tokenizers import BPETokenizer

    tok = BPETokenizer.train([CORPUS], 300)
    tok.save(root / "tok")
    hf = root / "hf"
    hf.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(root / "tok" / name, hf / name)
    eot = tok.special_tokens["<|endoftext|>"]
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=tok.vocab_size, n_positions=GPT2_C, n_embd=32, n_layer=2, n_head=4,
        bos_token_id=eot, eos_token_id=eot, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(hf)
    return hf


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
