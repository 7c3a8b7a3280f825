"""Every key of an imported checkpoint's files, every wrong value (issue 45, item 5).

The files are tests/fixtures/hf_fields (written by transformers: config.json of each family,
tokenizer_config.json, generation_config.json and special_tokens_map.json). The walk finds every
key in them, nested ones and list items included, and sets each one in turn to: deleted, null,
each JSON type it is not, -1, 0, NaN, infinity, 10**12 and an empty string. Each mutated file is
read the way `import-hf` reads it (`lmjax.io.hf.load`; the tokenizer, its chat template and the
stop ids `chat` uses), and must:

  - load, or raise one `lmjax.errors` line naming the file and the key;
  - never read a wrong type, a negative or non-finite number or an empty string as if the key
    were absent (the silent fallback that hid a mistyped eos_token);
  - where the key is absent or null and loads, give what the documented default gives (the
    table of docs/interop.md, "Every field of an imported checkpoint", read here: a key the
    table lacks is one lmjax does not read, and no value of it may change the result).

A key added to the fixture files is walked without a new line here. The walk reads headers and
tiny tensors, compiles nothing (about 3 s for ~2,000 files). The commands themselves run on a
few of the same files (`test_the_commands_give_the_same_one_line`), and a claimed size of 10**12
is refused before any tensor is read or allocated (`test_huge_claimed_sizes_allocate_nothing`).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import tracemalloc
from pathlib import Path

import jax
import pytest
from _llama_run import tokenizer

from lmjax import chat, cli, models
from lmjax.errors import LMJaxError
from lmjax.io import hf, hf_files, hf_gpt2, hf_llama_config
from lmjax.tokenizers import load_hf_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hf_fields"
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
TOKENIZER_FILES = ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
HUGE = 10**12
DELETED = object()
# Wrong values no key may take as "absent" without a word (a chat never stopped at an
# eos_token of 2: it was read as no eos_token).
_NOT_ABSENT = ("bool", "str", "list", "object", "negative", "NaN", "infinite", "empty")
_TYPES = {"bool": True, "int": 7, "float": 0.5, "str": "x", "list": [], "object": {}}


def _json_type(value) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def mutations(value):
    """(label, new value or DELETED) of one key holding `value`."""
    yield "deleted", DELETED
    yield "null", None
    for label, wrong in _TYPES.items():
        if _json_type(wrong) != _json_type(value):
            yield label, wrong
    yield from [("negative", -1), ("zero", 0), ("NaN", math.nan), ("infinite", math.inf)]
    yield from [("huge", HUGE), ("empty", "")]


def key_paths(doc, prefix=()):
    """Every key path of a JSON document: dict keys and list indices, depth first."""
    if isinstance(doc, dict):
        items = doc.items()
    elif isinstance(doc, list):
        items = enumerate(doc)
    else:
        return
    for key, value in items:
        yield prefix + (key,), value
        yield from key_paths(value, prefix + (key,))


def mutated(doc, path, new):
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if new is DELETED:
        del node[path[-1]]
    else:
        node[path[-1]] = new
    return doc


def documented_defaults() -> dict[tuple[str, str], dict[str, tuple[str, bool, bool]]]:
    """{(file, family or ""): {dotted key: (default, null has its own meaning, conditional)}}
    from docs/interop.md's field table; a default is a JSON literal, 'required' or 'not set'.
    Where the row says `(null: ...)`, only absence takes the default; `read only with` another
    key: a value is not checked while that key is off."""
    text = (ROOT / "docs" / "interop.md").read_text()
    section = text.split("## Every field of an imported checkpoint", 1)[1].split("\n## ", 1)[0]
    table: dict[tuple[str, str], dict[str, tuple[str, bool, bool]]] = {}
    row = re.compile(r"^\| `([\w.]+)`([\w ]*) \| `([\w.]+)` \| (`[^`]+`|required|not set)(.*)")
    for found in map(row.match, section.splitlines()):
        if found:
            file, families, key, default, rest = found.groups()
            for family in families.split() or [""]:
                flags = ("(null: " in rest, "read only with" in rest)
                table.setdefault((file, family), {})[key] = (default.strip("`"), *flags)
    assert len(table) == 7, sorted(table)  # 5 config.json, tokenizer_ and generation_config
    return table


DEFAULTS = documented_defaults()


def _name(path) -> str:
    return ".".join(k for k in path if isinstance(k, str))


# ---- what import-hf (and chat) read from each file -------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: directory with its fixture config.json and matching model.safetensors}."""
    root = tmp_path_factory.mktemp("hf_fields")
    out = {}
    for family in FAMILIES:
        config = json.loads((FIXTURES / family / "config.json").read_text())
        directory = root / family
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        cfg = _config(family, config)
        hf.save(models.init(jax.random.key(0), cfg), cfg, root / f"{family}-saved")
        shutil.copy(root / f"{family}-saved" / "model.safetensors", directory)
        out[family] = directory
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer(chat=True).save(str(directory / "tokenizer.json"))
    return directory


def _config(family: str, config: dict) -> models.ModelConfig:
    if family == "gpt2":
        return hf_gpt2.config_from_hf(config)
    return hf_llama_config.config_from_hf(config, "float32", "config.json")[0]


def _model_outcome(directory: Path):
    return hf.load(directory)[1]


def _tokenizer_outcome(directory: Path):
    tok = load_hf_tokenizer(directory)
    stops = chat.stop_ids(tok, chat.read_generation_config(directory), tok.vocab_size)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    return stops, ids, tok.template_variables()


def _attempt(read, directory):
    """('ok', result) or ('error', message); any other exception fails the test."""
    try:
        return "ok", read(directory)
    except LMJaxError as err:
        return "error", str(err)


def _walk(directory: Path, file: str, defaults: dict, read) -> list[str]:
    """Every mutation of every key of `directory/file`; the list of broken promises."""
    path_of = directory / file
    original = path_of.read_text()
    base = json.loads(original)
    expected_base = read(directory)
    problems = []

    def outcome(doc):
        path_of.write_text(json.dumps(doc))
        return _attempt(read, directory)

    try:
        for path, value in list(key_paths(base)):
            name, key = _name(path), [k for k in path if isinstance(k, str)][-1]
            default, null_own, conditional = defaults.get(name, (None, False, False))
            for label, new in mutations(value):
                takes_default = label == "deleted" or (label == "null" and not null_own)
                kind, got = outcome(mutated(base, path, new))
                where = f"{file} {name} {label}"
                if default is None and (kind, got) != ("ok", expected_base):
                    problems.append(f"{where}: a key lmjax does not read changed the result")
                elif kind == "error":
                    one_line = "\n" not in got and file in got and key in got
                    if not one_line:
                        problems.append(f"{where}: error does not name {file} and {key!r}: {got}")
                elif takes_default and default == "required":
                    problems.append(f"{where}: a required key was not refused")
                elif default is None:
                    continue  # not read, and the result is the file's own
                elif conditional and not takes_default:
                    continue  # read only with another key, which this file does not set
                elif label in _NOT_ABSENT and (kind, got) == outcome(mutated(base, path, DELETED)):
                    problems.append(f"{where}: a wrong value was read as if the key were absent")
                elif takes_default and default != "required":
                    as_default = (
                        mutated(base, path, DELETED)
                        if default == "not set"
                        else mutated(base, path, json.loads(default))
                    )
                    if (kind, got) != outcome(as_default):
                        problems.append(f"{where}: not the documented default {default}")
    finally:
        path_of.write_text(original)
    return problems


@pytest.mark.parametrize("family", FAMILIES)
def test_every_key_of_config_json_loads_as_documented_or_is_one_line(checkpoints, family):
    defaults = DEFAULTS[("config.json", family)]
    problems = _walk(checkpoints[family], "config.json", defaults, _model_outcome)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("file", TOKENIZER_FILES)
def test_every_key_of_the_tokenizer_files_loads_as_documented_or_is_one_line(tokenizer_dir, file):
    for name in TOKENIZER_FILES:
        shutil.copy(FIXTURES / "tokenizer" / name, tokenizer_dir)
    defaults = DEFAULTS.get((file, ""), {})
    problems = _walk(tokenizer_dir, file, defaults, _tokenizer_outcome)
    assert not problems, "\n".join(problems[:20])


def test_the_walk_covers_every_documented_key():
    """Each row of the table names a key some fixture file holds (else the walk skips it)."""
    for (file, family), keys in DEFAULTS.items():
        where = FIXTURES / (family or "tokenizer") / file
        names = {_name(p) for p, _ in key_paths(json.loads(where.read_text()))}
        missing = sorted(set(keys) - names)
        assert not missing, f"{where} lacks {missing}: add them to make_fixtures.py"


# ---- the commands, on a few of the same files ------------------------------------------------


def _refused_in_one_line(argv, capsys, *names: str) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmjax {argv[0]}: error: "), captured.err
    assert all(name in lines[0] for name in names), (names, lines[0])
    assert captured.out == ""


@pytest.fixture(scope="module")
def llama_dir(checkpoints, tokenizer_dir, tmp_path_factory):
    """The llama checkpoint with the fixture tokenizer files beside it."""
    directory = tmp_path_factory.mktemp("llama_with_tokenizer") / "hf"
    shutil.copytree(checkpoints["llama"], directory)
    shutil.copy(tokenizer_dir / "tokenizer.json", directory)
    for name in TOKENIZER_FILES:
        shutil.copy(FIXTURES / "tokenizer" / name, directory)
    return directory


def _edit(path: Path, **changes) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_the_commands_give_the_same_one_line(llama_dir, tmp_path, capsys):
    """import-hf refuses a bad config.json or tokenizer file and writes nothing; eval, generate
    and chat refuse an imported run whose tokenizer files were broken afterwards, before any
    compile (every line names the file and the key)."""
    for i, (file, changes, key) in enumerate(
        [
            ("config.json", dict(vocab_size=HUGE), "vocab_size"),
            ("config.json", dict(max_position_embeddings=HUGE), "max_position_embeddings"),
            ("config.json", dict(rms_norm_eps=math.nan), "rms_norm_eps"),
            ("tokenizer_config.json", dict(eos_token=2), "eos_token"),
            ("tokenizer_config.json", dict(eos_token="two tokens"), "eos_token"),
            ("generation_config.json", dict(eos_token_id=-1), "eos_token_id"),
        ]
    ):
        source = tmp_path / f"source{i}"
        shutil.copytree(llama_dir, source)
        _edit(source / file, **changes)
        out = tmp_path / f"run{i}"
        _refused_in_one_line(["import-hf", str(source), "--out", str(out)], capsys, file, key)
        assert not out.exists()
    run = tmp_path / "run"
    assert cli.main(["import-hf", str(llama_dir), "--out", str(run)]) == 0
    capsys.readouterr()
    commands = [
        ["eval", str(run)],
        ["generate", "--run", str(run), "--prompt", "The", "--max-new-tokens", "2"],
        ["chat", str(run), "--message", "hi", "--max-new-tokens", "2"],
    ]
    tokenizer_config = run / "tokenizer" / "tokenizer_config.json"
    _edit(tokenizer_config, bos_token=["<|endoftext|>"])
    for argv in commands:
        _refused_in_one_line(argv, capsys, "tokenizer_config.json", "bos_token")
    _edit(tokenizer_config, bos_token=None, eos_token="")
    for argv in commands[2:]:
        _refused_in_one_line(argv, capsys, "tokenizer_config.json", "eos_token")
    shutil.copy(FIXTURES / "tokenizer" / "tokenizer_config.json", tokenizer_config)
    _edit(run / "tokenizer" / "generation_config.json", eos_token_id=[2, math.inf])
    _refused_in_one_line(commands[2], capsys, "generation_config.json", "eos_token_id")


@pytest.mark.parametrize("family", FAMILIES)
def test_huge_claimed_sizes_allocate_nothing(checkpoints, family, monkeypatch):
    """Each size key of 10**12 is refused from the config and the safetensors headers alone:
    no tensor is read (`read_state` and `stacked_params` fail the test if reached), and under
    1 MiB is traced while it runs (the files are a few KiB; one claimed row of a 10**12-token
    embedding would be 4 TB)."""

    def reached(*_):
        raise AssertionError("a tensor was read for a config claiming 10**12")

    monkeypatch.setattr(hf_files, "read_state", reached)
    monkeypatch.setattr(hf_files, "stacked_params", reached)
    directory = checkpoints[family]
    original = (directory / "config.json").read_text()
    config = json.loads(original)
    sizes = [k for k in config if k.startswith(("vocab", "max_pos", "n_", "num_", "hidden_s"))]
    sizes += [k for k in ("intermediate_size", "head_dim") if k in config]
    sizes += ["sliding_window"] if family == "mistral" else []  # qwen: off (use_sliding_window)
    assert len(sizes) >= 5, sizes
    try:
        for key in sizes:
            # without layer_types too: qwen's per-layer list is then derived, never built
            derived = {k: v for k, v in config.items() if k != "layer_types"}
            for doc in (config | {key: HUGE}, derived | {key: HUGE}):
                (directory / "config.json").write_text(json.dumps(doc))
                tracemalloc.start()
                try:
                    with pytest.raises(LMJaxError) as info:
                        hf.load(directory)
                    peak = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
                assert "config.json" in str(info.value) and key in str(info.value), str(info.value)
                assert peak < 2**20, (key, peak)
    finally:
        (directory / "config.json").write_text(original)
