"""`lmjax chat` as a person lives with it (issue 47): a full context, Ctrl-C, Ctrl-D, commands,
and replies kept as the ids the model said.

The model: `_llama_run.imported_run(chat=True)`, a tiny random Llama (context 128) with a ChatML
template, whose greedy first reply to CHAT_PROMPT says a lone UTF-8 lead byte (ids that decode to
U+FFFD and encode back as other ids) and ends at <|im_end|>. A terminal is a pseudo-terminal
(`os.openpty`) that the child, leading a session of its own, opens as its controlling terminal,
so "\\x03" is the SIGINT a Ctrl-C sends and "\\x04" the end of input of a Ctrl-D; every read has
a deadline and the child is always killed.
Unit tests cover the pure parts (`parse_line`, `reply_room`, `Conversation`'s trimming and kept
ids) on the run's tokenizer. Cost: ~25 s (two chat processes, each importing jax, and the run).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _llama_run import CHAT_PROMPT, imported_run

from lmjax import cli, tokenizers
from lmjax.chat import Conversation
from lmjax.cli.chat import parse_line, reply_room
from lmjax.errors import ConfigError, TokenError

FIRST = CHAT_PROMPT[0]["content"]
LONG = "the lazy dog " * 12  # ~37 tokens
TOO_LONG = "fox " * 150  # more than the 128 positions by itself

# The child: `lmjax chat` whose first reply waits after its second token (a marker file tells
# the test it is there), so a Ctrl-C surely lands inside a reply; later replies run freely.
CHILD = """
import os, signal, sys, time
os.close(os.open(os.ttyname(0), os.O_RDWR))  # a session leader opening a terminal: its own
# As a process started by a non-interactive shell's `cmd &` inherits it (and this suite under
# `make test &` passes it on): SIGINT ignored. lmjax chat must hear Ctrl-C regardless.
signal.signal(signal.SIGINT, signal.SIG_IGN)
from lmjax import cli, generate
stream, marker = generate.stream, sys.argv.pop(1)

def paused(*args, **kwargs):
    for n, step in enumerate(stream(*args, **kwargs)):
        yield step
        if n == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            for _ in range(600):  # a slow step: Ctrl-C is heard between its parts
                time.sleep(0.1)

generate.stream = paused
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return imported_run(tmp_path_factory.mktemp("chat"), chat=True)


@pytest.fixture(scope="module")
def tok(run):
    return tokenizers.load(run / "tokenizer")


# ---- the terminal ---------------------------------------------------------------------------


class Terminal:
    """A child process on a pseudo-terminal: `type` keys, `expect` output by a deadline."""

    def __init__(self, argv: list[str]):
        self.master, child = os.openpty()
        self.proc = subprocess.Popen(
            argv,
            stdin=child,
            stdout=child,
            stderr=child,
            start_new_session=True,  # CHILD then makes this its controlling terminal
        )
        os.close(child)
        self.seen = self.log = ""  # what no expect consumed yet; everything

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """The first match of `pattern` in the output after what earlier expects consumed."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.seen)):
            ended = self.proc.poll() is not None and not self._read(0.1)
            if ended or time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in the output: {self.seen!r}")
            self._read(0.2)
        self.seen = self.seen[found.end() :]
        return found

    def wait_for(self, path: Path, timeout: float = 60.0) -> None:
        """Read the output until `path` exists (the child made it)."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert time.monotonic() < deadline and self.proc.poll() is None, self.seen
            self._read(0.1)

    def exit_code(self, timeout: float = 30.0) -> int:
        code = self.proc.wait(timeout)
        while self._read(0.1):
            pass
        return code

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        try:
            data = os.read(self.master, 65536) if ready else b""
        except OSError:  # the child closed the terminal
            return False
        text = data.decode(errors="replace").replace("\r\n", "\n")
        self.seen, self.log = self.seen + text, self.log + text
        return bool(data)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


@pytest.fixture
def terminal(run, tmp_path):
    terminals = []

    def start(*extra: str) -> Terminal:
        argv = [sys.executable, "-c", CHILD, str(tmp_path / "paused"), "chat", str(run)]
        terminals.append(Terminal([*argv, "--temperature", "0", *extra]))
        terminals[-1].paused = tmp_path / "paused"
        return terminals[-1]

    yield start
    for t in terminals:
        t.close()


def _prompt_and_reply(t: Terminal) -> tuple[list[int], list[int]]:
    prompt = json.loads(t.expect(r"prompt ids: (\[.*\])\n").group(1))
    return prompt, json.loads(t.expect(r"new ids: (\[.*\])\n").group(1))


def test_a_terminal_chat_survives_ctrl_c_a_full_context_and_reset(terminal, tok):
    t = terminal("--max-new-tokens", "16", "--show-ids")
    t.expect(r"> $")
    # Ctrl-C during the first reply stops it; the two ids said so far stay in the chat.
    t.type(FIRST + "\r")
    t.wait_for(t.paused)
    t.type("\x03")
    t.expect("lmjax chat: reply stopped")
    first, partial = _prompt_and_reply(t)
    assert len(partial) == 2
    t.expect(r"> $")
    t.type("And the dog?\r")
    prompt, _ = _prompt_and_reply(t)
    assert prompt[: len(first) + 2] == first + partial
    # /reset: the next prompt is the first again, no history.
    t.expect(r"> $")
    t.type("/reset\r")
    t.expect("a new conversation")
    t.type(FIRST + "\r")
    assert _prompt_and_reply(t)[0] == first
    # Long turns fill the context: the oldest exchange is forgotten, the chat goes on.
    t.type(LONG + "\r")
    _prompt_and_reply(t)
    t.type(LONG + "\r")
    t.expect(r"is full: forgot the oldest [24] messages to leave 16 for the reply")
    prompt, _ = _prompt_and_reply(t)
    assert len(prompt) + 16 <= 128 and FIRST not in tok.decode(prompt)
    # A turn that cannot fit by itself is refused in one line; the next one is answered.
    t.type(TOO_LONG + "\r")
    t.expect(r"lmjax chat: not sent: turn = '\d+ tokens'; expected fewer than context_length")
    t.type("And the dog?\r")
    _prompt_and_reply(t)
    # Ctrl-C on a typed line clears it; at an empty prompt it leaves, exit 0.
    t.expect(r"> $")
    t.type("half a thou")
    t.expect("half a thou")
    t.type("\x03")
    t.expect(r"> $")
    t.type("\x03")
    assert t.exit_code() == 0
    assert "Traceback" not in t.log and "error" not in t.log


def test_ctrl_d_leaves_the_chat(terminal):
    t = terminal()
    t.expect(r"> $")
    t.type("\x04")
    assert t.exit_code() == 0
    assert t.seen.strip() == ""


# ---- commands and refused turns, in-process -------------------------------------------------


def _chat(run, capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["chat", str(run), "--temperature", "0", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_commands_are_lmjax_s_and_never_reach_the_model(run, capsys):
    lines = ["/help", "/system Be brief.", "/system", "/bogus", "/exit", "never sent"]
    code, out, err = _chat(run, capsys, *(a for line in lines for a in ("--message", line)))
    assert code == 2  # a script's unknown command fails it, after the session
    assert "/reset" in out and "//TEXT" in out and "Ctrl-D" in out  # /help
    assert err.splitlines() == [
        "lmjax chat: the system message is set (the conversation so far is kept)",
        "lmjax chat: the system message is 'Be brief.'",
        'lmjax chat: /bogus is not a command (/help lists them); "//" sends a line with "/"',
    ]
    assert "never sent" not in out and "ids" not in out  # /exit ended it; no turn was decoded


def test_a_double_slash_sends_a_line_starting_with_a_slash(run, tok, capsys):
    code, out, err = _chat(
        run, capsys, "--message", "//etc?", "--max-new-tokens", "1", "--show-ids"
    )
    assert code == 0 and err == ""
    (prompt,) = re.findall(r"^prompt ids: (\[.*\])$", out, re.M)
    assert "<|im_start|>user\n/etc?<|im_end|>" in tok.decode(json.loads(prompt))


def test_a_turn_too_long_for_the_context_is_refused_and_the_chat_goes_on(run, capsys):
    argv = ["--message", TOO_LONG, "--message", FIRST, "--max-new-tokens", "4", "--show-ids"]
    code, out, err = _chat(run, capsys, *argv)
    assert code == 2  # a script's refused turn fails it, after the turns that fit
    (line,) = err.splitlines()
    assert re.fullmatch(
        r"lmjax chat: not sent: turn = '1\d\d tokens'; expected fewer than context_length = 128\. "
        r"Fix: shorten it, or send it in parts\.",
        line,
    )
    assert len(re.findall(r"^new ids: ", out, re.M)) == 1  # FIRST was answered


def test_an_empty_message_is_refused_before_loading(tmp_path, capsys):
    assert cli.main(["chat", str(tmp_path / "absent"), "--message", "hi", "--message", " "]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        "lmjax chat: error: --message = ' '; expected text to send (a blank turn is never sent). "
        "Fix: give the --message some text, or drop it."
    ]


# ---- the pure parts -------------------------------------------------------------------------


def test_parse_line():
    assert parse_line("/help") == ("help", "")
    assert parse_line("  /System   Be brief. ") == ("system", "Be brief.")
    assert parse_line("//etc/hosts?") == (None, "/etc/hosts?")
    assert parse_line("a /b") == (None, "a /b")
    assert parse_line("/") == ("", "")


def test_reply_room():
    assert reply_room(None, 128) == 64 and reply_room(None, 4096) == 200
    assert reply_room(127, 128) == 127
    with pytest.raises(ConfigError, match=r"--max-new-tokens = 128; expected an int in \[1, 127\]"):
        reply_room(128, 128)


def test_the_oldest_exchanges_go_first_and_the_system_message_stays(tok):
    chat = Conversation(tok, system="Be brief.")
    for n in range(3):
        chat.fit_turn(f"turn {n} " + LONG, 1000, 8)
        chat.add_reply(f"reply {n}", tok.encode(f"reply {n}", add_special_tokens=False))
    full = len(chat.ids())
    ids, dropped = chat.fit_turn("last", full, 8)  # 8 free needs at least one exchange gone
    assert dropped == 2 and len(ids) + 8 <= full and ids == chat.ids()
    assert [m["content"][:6] for m in chat.messages] == ["Be bri", "turn 1", "reply ", "turn 2",
                                                         "reply ", "last"]  # fmt: skip
    with pytest.raises(TokenError, match="turn = '1[0-9][0-9] tokens with the system message'"):
        chat.fit_turn(TOO_LONG, 128, 8)
    assert chat.messages[-1]["content"] == "last"  # the refused turn left nothing behind
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "Be brief."}]
    chat.system = None
    assert chat.messages == [] and chat.system is None


def test_a_reply_keeps_the_ids_the_model_said(tok):
    said = [260, 191, 166]  # "do", a NUL byte, a lone UTF-8 lead byte: decodes to "do\x00\ufffd"
    text = tok.decode(said, skip_special_tokens=True)
    assert tok.encode(text, add_special_tokens=False) != said
    kept, retold = Conversation(tok), Conversation(tok)
    first = kept.prompt_ids(FIRST)
    retold.prompt_ids(FIRST)
    kept.add_reply(text, said)
    retold.add_reply(text)  # the text alone: encoded again, as transformers would
    second = kept.prompt_ids("And the dog?")
    assert second[: len(first) + 3] == first + said
    assert tok.decode(second) == tok.decode(retold.prompt_ids("And the dog?"))
    assert retold.ids() == tok.apply_chat_template(retold.messages, add_generation_prompt=True)
    assert second != retold.ids()


def test_a_template_that_rewrites_a_reply_gets_its_text(run):
    tok = tokenizers.load(run / "tokenizer")
    tok.chat_template = tok.chat_template.replace("m['content']", "m['content'] | trim")
    chat = Conversation(tok)
    chat.prompt_ids(FIRST)
    chat.add_reply("  the dog  ", tok.encode("  the dog  ", add_special_tokens=False))
    ids = chat.prompt_ids("And?")
    assert ids == tok.apply_chat_template(chat.messages, add_generation_prompt=True)


def test_a_second_ctrl_c_after_a_cleared_line_leaves(monkeypatch, capsys):
    """Ctrl-C on a typed line clears it; the next Ctrl-C, at that now empty prompt, leaves even
    if readline's buffer still reports the cleared text."""
    readline = pytest.importorskip("readline")
    from lmjax.cli import chat as chat_cli

    keys = iter(["hello", KeyboardInterrupt, KeyboardInterrupt, "never read"])

    def typed(prompt):
        key = next(keys)
        if key is KeyboardInterrupt:
            signal.raise_signal(signal.SIGINT)  # as a terminal's Ctrl-C: the handler raises
        return key

    monkeypatch.setattr("builtins.input", typed)
    monkeypatch.setattr(readline, "get_line_buffer", lambda: "half a thou")
    assert list(chat_cli._typed_lines()) == ["hello"]
    assert next(keys) == "never read"


# The prompt alone, on a terminal, in a process with another thread: each marker file makes
# that thread send SIGINT to itself, as the kernel may hand a Ctrl-C to any of JAX's threads.
ELSEWHERE_CHILD = """
import os, signal, sys, threading, time
os.close(os.open(os.ttyname(0), os.O_RDWR))
from lmjax.cli import chat
marker = sys.argv[1]

def elsewhere():
    for n in range(2):
        while not os.path.exists(f"{marker}{n}"):
            time.sleep(0.01)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

threading.Thread(target=elsewhere, daemon=True).start()
for line in chat._typed_lines():
    print(f"got {line!r}", flush=True)
print("left", flush=True)
"""


def test_ctrl_c_caught_by_another_thread_still_reaches_the_prompt(tmp_path):
    """Without the watcher, the main thread sleeps on in readline's select() and the first
    expect below times out; with it, the line clears and the second Ctrl-C leaves."""
    pytest.importorskip("readline")
    marker = tmp_path / "sigint"
    t = Terminal([sys.executable, "-c", ELSEWHERE_CHILD, str(marker)])
    try:
        t.expect(r"> $")
        t.type("kept\r")
        t.expect("got 'kept'")
        t.expect(r"> $")
        t.type("half a thou")
        t.expect("half a thou")
        (tmp_path / "sigint0").touch()
        t.expect(r"> $", timeout=20)
        (tmp_path / "sigint1").touch()
        t.expect("left", timeout=20)
        assert t.exit_code() == 0
        assert "got 'half a thou'" not in t.log
    finally:
        t.close()
