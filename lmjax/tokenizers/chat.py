"""Chat templates: a Hugging Face tokenizer_config.json's Jinja `chat_template`, rendered the
way transformers renders it, and the assistant-token mask supervised fine-tuning needs.

    render(template, messages, add_generation_prompt, variables) -> text
        jinja2's ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols) with
        transformers' globals: raise_exception(msg), strftime_now(fmt), a `tojson` filter that
        does not escape HTML, `dict`, a `namespace` refusing `_names`, a `{% generation %}` tag
        that renders its body; template variables messages, tools=None, documents=None,
        add_generation_prompt and the special-token strings (bos_token, eos_token, ...).
        A template is code from a downloaded file: it cannot reach files, the environment or
        Python internals (the sandbox), `*`, `**` and `%` may not build values past `_MAX_SIZE`, and
        whatever else it raises (1/0, a type error, jinja2's own `inf` slip) is one error line.

The assistant mask (`render_with_mask`) is found by rendering prefixes: assistant message k
spans the characters from the end of `render(messages[:k], add_generation_prompt=True)` (the
conversation so far plus the assistant header) to the end of `render(messages[:k + 1])` (its
content and end-of-turn text). That needs a template whose rendering of a prefix of the
conversation is a prefix of the rendering of the whole, and anything else is refused. The whole
conversation is encoded once (so the ids equal `apply_chat_template`'s), and a token is masked
when its bytes overlap an assistant span (transformers' rule for its `{% generation %}` masks).
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from itertools import accumulate
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from lmjax.errors import FileFormatError, TokenError

_FIX_MESSAGES = "pass a list of {'role': ..., 'content': ...} dicts the template accepts"


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
SPECIAL_TOKENS += ("sep_token", "cls_token", "mask_token")


def special_tokens(config: dict, where: Path) -> dict[str, str]:
    """The special-token strings of a tokenizer_config.json (`where`), by name: each a str or
    {"content": str, ...}; absent or null: not set. Anything else is one error line naming the
    key (it was read as "not set", so a chat never stopped at an `eos_token` of 2)."""
    found = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        text = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(text, str):
            raise FileFormatError.describe(
                f"{where}: {name}",
                value,
                'a token string, {"content": string, ...} or null',
                "fix the tokenizer_config.json",
            )
        if text is not None:
            found[name] = text
    return found


def config_template(config: dict, where: Path) -> str | None:
    """The chat template in a tokenizer_config.json: a str, or the 'default' of a named list."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise FileFormatError.describe(
        f"{where.parent / 'tokenizer_config.json'}: chat_template",
        template,
        "a Jinja string or a list of {'name', 'template'} with a 'default'",
        "fix the tokenizer_config.json",
    )


class _Generation(jinja2.ext.Extension):
    """`{% generation %} ... {% endgeneration %}`: renders its body (masks come from prefixes)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace without `_names`, which could reach CPython internals."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a namespace attribute may not start with '_': {name!r}"
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


_MAX_SIZE = 1 << 20  # items of a repeated str/list, bits of an int power: far past any chat


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with `'x' * n`, `a ** b` and `'%099999999d' % x` bounded:
    unbounded, one line of a template (`{{ 2 ** 999999999 }}`) hangs the process or takes all
    its memory. (A loop of loops or a filter such as `center` can still spend both: the fuzz
    harness bounds those by time and resident size.)"""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator, left, right):
        if operator == "**" and _power_bits(left, right) > _MAX_SIZE:
            raise jinja2.exceptions.SecurityError(f"{left!r} ** {right!r} is too large")
        if operator == "*" and _repeat_size(left, right) > _MAX_SIZE:
            raise jinja2.exceptions.SecurityError(f"a sequence * {right!r} is too large")
        if operator == "%" and isinstance(left, str) and _format_width(left) > _MAX_SIZE:
            raise jinja2.exceptions.SecurityError(f"a %-format width past {_MAX_SIZE}")
        return super().call_binop(context, operator, left, right)


def _power_bits(base, exponent) -> int:
    """About how many bits `base ** exponent` takes (0 where it is not an int power)."""
    if not all(isinstance(v, int) for v in (base, exponent)) or exponent <= 0 or abs(base) < 2:
        return 0
    return exponent * abs(base).bit_length()


def _repeat_size(left, right) -> int:
    """How many items `left * right` holds where one side is a sequence and the other an int."""
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            return len(seq) * n
    return 0


def _format_width(text: str) -> int:
    """The widest field width or precision of a printf-style format string (0 if none)."""
    fields = re.findall(r"%[-#0 +]*(\d*)(?:\.(\d*))?", text)
    return max((int(d) for pair in fields for d in pair if d), default=0)


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The template compiled in transformers' sandbox (cached: one template per tokenizer)."""
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=lambda *args, **kwargs: dict(*args, **kwargs),
        namespace=_Namespace,
    )
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise FileFormatError.describe(
            f"chat_template line {err.lineno}",
            err.message,
            "a valid Jinja template",
            "fix the template",
        ) from None
    # jinja2's compiler, or Python's on the code it generated (200 nested `+`: too many
    # nested parentheses, a SyntaxError that is no TemplateSyntaxError)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as err:
        reason = f"{type(err).__name__}: {err}"
        raise FileFormatError.describe(
            "chat_template", reason, "a valid Jinja template", "fix the template"
        ) from None


def _plain_messages(messages) -> list[dict]:
    """`messages` as a fresh list of dicts, keys with None values dropped (as transformers)."""
    ok = isinstance(messages, (list, tuple)) and all(isinstance(m, dict) for m in messages)
    if not ok:
        raise TokenError.describe("chat messages", messages, "a list of dicts", _FIX_MESSAGES)
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def render(template: str | None, messages, add_generation_prompt: bool, variables: dict) -> str:
    """The text of `messages` through `template` (see the module docstring); one error line if
    there is no template or the template fails (e.g. its raise_exception refusing a role)."""
    if template is None:
        raise FileFormatError.describe(
            "chat_template",
            None,
            "a tokenizer_config.json with a chat_template",
            "use a chat model's tokenizer",
        )
    compiled = compile_template(template)
    context = {"tools": None, "documents": None, **variables}
    try:
        return compiled.render(
            messages=_plain_messages(messages),
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.exceptions.TemplateError as err:  # raise_exception, an undefined call, security
        raise TokenError.describe(
            "chat template rendering", str(err), "messages the template accepts", _FIX_MESSAGES
        ) from None
    except Exception as err:  # noqa: BLE001 - the template is code: 1/0, 'a' + 1, jinja2's `inf`
        raise TokenError.describe(
            "chat template rendering",
            f"{type(err).__name__}: {err}",
            "a template that renders these messages",
            "fix the chat template (it failed as code, not on the messages)",
        ) from None


def assistant_spans(
    template: str | None, messages, variables: dict
) -> tuple[str, list[tuple[int, int]]]:
    """`(text of all messages, [(start, end) character span of each assistant message])`."""
    messages = _plain_messages(messages)
    text = render(template, messages, False, variables)
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(template, messages[:k], True, variables)
        upto = render(template, messages[: k + 1], False, variables)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise TokenError.describe(
                f"chat template rendering of messages[:{k + 1}]",
                upto[-60:],
                "a prefix of the whole conversation's rendering (prefix-stable template)",
                "the assistant mask needs a template that renders earlier turns the same way",
            )
        spans.append((len(before), len(upto)))
    return text, spans


def render_with_mask(tokenizer, messages, variables: dict) -> tuple[list[int], list[int]]:
    """`(ids, mask)` of the conversation: mask[i] = 1 iff token i's bytes overlap an assistant span.

    `tokenizer` is an `HFTokenizer` (its `encode_parts` gives each token's byte length).
    """
    variables = tokenizer.template_variables() | dict(variables)
    text, spans = assistant_spans(tokenizer.chat_template, messages, variables)
    if tokenizer.normalize(text) != text:
        raise TokenError.describe(
            "rendered chat",
            "changed by the tokenizer's NFC normalizer",
            "NFC text",
            "normalize the messages first: unicodedata.normalize('NFC', content)",
        )
    parts = tokenizer.encode_parts(text)
    ends = list(accumulate(n for _, n in parts))
    byte_spans = [(len(text[:s].encode("utf-8")), len(text[:e].encode("utf-8"))) for s, e in spans]
    mask = []
    for end, (_, n) in zip(ends, parts, strict=True):
        start = end - n
        mask.append(int(any(start < e and end > s for s, e in byte_spans)))
    return [i for i, _ in parts], mask
