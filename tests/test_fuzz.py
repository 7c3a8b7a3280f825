"""The fuzz targets' short run in the suite (issue 45, item 4), and each finding's regression.

fuzz/targets.py feeds bytes to what lmjax reads from a user or a downloaded checkpoint; each
target must return or raise an `lmjax.errors` exception. Here each runs its committed seeds
and `INPUTS` deterministic mutations of them (fuzz/mutate.py: the same inputs every run, no
atheris needed), with a hang past 5 s or a resident size past the bound counted as a finding.
The long, coverage-guided runs are `make fuzz` and benchmarks/fuzz_campaign.py.

Every input a fuzzer found (fuzz/findings/TARGET/*) runs again here, and the findings that were
fixed are pinned to the one-line error they now give.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from lmjax.errors import ConfigError, FileFormatError, LMJaxError, TokenError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fuzz"))
import mutate  # noqa: E402
import targets  # noqa: E402

INPUTS = 1000  # per target: ~1-3 ms each on one core
FINDINGS = sorted(p for p in (ROOT / "fuzz" / "findings").glob("*/*") if p.is_file())


@pytest.mark.parametrize("target", list(targets.TARGETS))
def test_each_target_takes_mutated_inputs(target, tmp_path):
    """A finding's input is kept under tmp_path (named in the failure), not in fuzz/findings/."""
    ran = mutate.run(target, INPUTS, findings=tmp_path)
    assert ran == INPUTS + len(mutate.seeds(target))


@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_finding_is_now_accepted_or_one_lmjax_error(path):
    mutate.checked_run(path.parent.name, path.read_bytes())


def _finding(target: str, name: str) -> bytes:
    return (ROOT / "fuzz" / "findings" / target / name).read_bytes()


def test_the_findings_give_one_line_naming_the_file(tmp_path):
    """What each fixed finding raised (or did) before, and the line it gives now."""
    from lmjax.config import load_run_config
    from lmjax.data.corpus_files import BadRecords, documents
    from lmjax.tokenizers import chat, load_hf_tokenizer

    # a corrupt parquet file: pyarrow's ArrowInvalid escaped
    bad = tmp_path / "c.parquet"
    bad.write_bytes(_finding("corpus_parquet", "mutate-9a891c80"))
    with pytest.raises(FileFormatError, match=r"parquet file .*c\.parquet = .*readable parquet"):
        list(documents([bad], "text", BadRecords(skip=False)))
    # a vocab id near 10**12: decode's set of undefined ids took all memory (MemoryError)
    (tmp_path / "tokenizer.json").write_bytes(_finding("tokenizer_json", "mutate-dabcc1bc"))
    with pytest.raises(FileFormatError, match=r"tokenizer.json: largest token id = \d+; expected"):
        load_hf_tokenizer(tmp_path)
    # a template with 1e309: jinja2 compiles it to `inf`, a NameError at render
    config = json.loads(_finding("tokenizer_config", "mutate-c0cea98e"))
    assert "1e309" in config["chat_template"]
    targets.run_one("tokenizer_config", json.dumps(config).encode())
    # a model config with `name` beside its preset (atheris's campaign, run_config; its input
    # was lost, this is the traceback's cause): preset()'s own TypeError escaped
    (tmp_path / "run.yaml").write_bytes(_finding("run_config", "atheris-preset-name"))
    with pytest.raises(ConfigError, match=r"model config key = 'name'; expected one of \["):
        load_run_config(tmp_path / "run.yaml")
    # 200 unary `+` in a template (atheris, tokenizer_config): the Python jinja2 generates has
    # too many nested parentheses, a SyntaxError from compile() that escaped
    config = json.loads(_finding("tokenizer_config", "atheris-ebcdfa98"))
    assert "+" * 200 in config["chat_template"]
    template = config["chat_template"]
    with pytest.raises(FileFormatError, match=r"SyntaxError: too many nested parentheses"):
        chat.render(template, [{"role": "user", "content": "hi"}], True, {})


# ---- the sandbox: a chat template is code from a downloaded file ----------------------------


_ENV = "environ['LMJAX_FUZZ_CANARY']"


@pytest.mark.parametrize(
    "escape",
    [
        "{{ raise_exception.__globals__['os']." + _ENV + " }}",
        "{{ strftime_now.__globals__['__builtins__']['open']('secret.txt').read() }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ namespace.__init__.__globals__['os']." + _ENV + " }}",
        "{{ '{0.__class__.__init__.__globals__[os].environ}'.format(messages) }}",
        "{{ cycler.__init__.__globals__.os." + _ENV + " }}",
        "{% include 'secret.txt' %}",
        "{% import 'secret.txt' as s %}",
        "{{ messages.append(1) }}{{ messages }}",
        "{{ self._TemplateReference__context }}",
    ],
)
def test_a_chat_template_cannot_reach_files_the_environment_or_internals(
    escape, tmp_path, monkeypatch
):
    """Each is refused in one TokenError line, or renders without reaching what it reached
    for (jinja2's sandbox makes an unsafe attribute an undefined value, printed empty)."""
    from lmjax.tokenizers.chat import render

    monkeypatch.setenv("LMJAX_FUZZ_CANARY", targets.CANARY)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.txt").write_text(targets.CANARY)
    try:
        text = render(escape, [{"role": "user", "content": "hi"}], True, {})
    except TokenError as err:
        text = str(err)
        assert "\n" not in text
    assert targets.CANARY not in text and "<class" not in text and "'hi'}, 1]" not in text


@pytest.mark.parametrize(
    "template",
    [
        "{{ 2 ** 99999999 }}",
        "{% set n = 99999999 %}{{ 'x' * n }}",
        "{{ [0] * 99999999 }}",
        "{{ '%0999999999d' % 1 }}",
        "{{ 1 / 0 }}",
        "{{ 'a' + 1 }}",
        "{{ 1e309 }}{{ messages[1e309] }}",
    ],
)
def test_a_chat_template_that_would_hang_or_crash_is_one_line(template):
    """Refused in one TokenError line within a second (unbounded, the first four take minutes
    or GBs; the last three raised ZeroDivisionError, TypeError and jinja2's NameError)."""
    from lmjax.tokenizers.chat import render

    start = time.monotonic()
    with pytest.raises(TokenError) as info:
        render(template, [{"role": "user", "content": "hi"}], True, {})
    assert "\n" not in str(info.value) and time.monotonic() - start < 1.0


def test_a_template_still_renders_what_transformers_allows():
    from lmjax.tokenizers.chat import render

    template = "{{ 2 ** 10 }} {{ 'ab' * 3 }} {{ '%5.1f|%s' % (3.14, 'x') }} {{ 7 * 6 }}"
    assert render(template, [], False, {}) == "1024 ababab   3.1|x 42"


# ---- the harness itself flags what it promises to ------------------------------------------


def test_the_harness_flags_other_exceptions_hangs_memory_and_the_canary(monkeypatch):
    def raises(data, root):
        raise KeyError("not an lmjax error")

    def hangs(data, root):
        time.sleep(5)

    def leaks_canary(data, root):
        template = json.dumps({"chat_template": targets.CANARY}).encode()
        targets.tokenizer_config(template, root)

    monkeypatch.setitem(targets.TARGETS, "raises", raises)
    monkeypatch.setitem(targets.TARGETS, "hangs", hangs)
    monkeypatch.setitem(targets.TARGETS, "leaks_canary", leaks_canary)
    with pytest.raises(KeyError):
        mutate.checked_run("raises", b"")
    with pytest.raises(targets.Finding, match="read the canary"):
        mutate.checked_run("leaks_canary", b"")
    monkeypatch.setattr(mutate, "TIMEOUT_S", 0.2)
    with pytest.raises(targets.Finding, match="ran past 0.2 s"):
        mutate.checked_run("hangs", b"")
    monkeypatch.setattr(mutate, "TIMEOUT_S", 60)
    assert 50 < mutate._peak_mb() < 10**6  # this process's high-water mark, in MB
    assert 50 < mutate._resident_mb() <= mutate._peak_mb() + 1  # and its resident size now
    # An input that adds more than the bound over what the process held is a finding ...
    peaks = iter([300.0, 5000.0])  # the high-water mark before and after one input
    monkeypatch.setattr(mutate, "_peak_mb", lambda: next(peaks))
    monkeypatch.setattr(mutate, "_resident_mb", lambda: 280.0)
    with pytest.raises(targets.Finding, match="resident size 5000 MB, 4720 MB more than before"):
        mutate.checked_run("corpus_txt", b"text")
    # ... but not one that nudges past 4 GiB a worker that other tests took near it (seen in
    # the full suite: a pytest worker held 5.6 GB, and a parquet input raised its mark).
    peaks = iter([5600.0, 5640.0])
    monkeypatch.setattr(mutate, "_peak_mb", lambda: next(peaks))
    monkeypatch.setattr(mutate, "_resident_mb", lambda: 4900.0)
    mutate.checked_run("corpus_txt", b"text")
    assert issubclass(targets.Finding, Exception) and not issubclass(targets.Finding, LMJaxError)


def test_a_finding_is_saved_where_asked_and_named(monkeypatch, tmp_path):
    """mutate.run keeps a failing input under `findings` (the suite's temporary directory, not
    fuzz/findings/) and names the file in the exception's notes."""

    def fails_off_seed(data, root):
        if data != b"seed":
            raise ValueError("not an lmjax error")

    monkeypatch.setitem(targets.TARGETS, "fails_off_seed", fails_off_seed)
    monkeypatch.setattr(mutate, "seeds", lambda target: [b"seed"])
    with pytest.raises(ValueError) as caught:
        mutate.run("fails_off_seed", 5, findings=tmp_path)
    (saved,) = (tmp_path / "fails_off_seed").iterdir()
    assert saved.read_bytes() != b"seed" and f"the input: {saved}" in caught.value.__notes__
