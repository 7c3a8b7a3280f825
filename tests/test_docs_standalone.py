"""The documentation stands on its own: what a user's clone holds is all it points to.

- Every link in README.md, docs/*.md and the notebooks' markdown cells stays in the
  repository: a relative target resolves to a file or directory inside the checkout (a
  `#heading` after a markdown file names one of its headings), and so does any bare `../` path
  written in the text. The contract and the reference documents lie beside the checkout, not in
  it, so a link to them would break in every clone.
- No absolute http(s) address at all (`ALLOWED_URLS` is empty): outside projects are named in
  words, as the README's peers are, so no page rots when someone else's site moves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Outside addresses a page may link to. Empty on purpose (issue 35: the docs never link outside
# the repository); an entry needs a reason a user cannot do without the link.
ALLOWED_URLS: tuple[str, ...] = ()

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
URL = re.compile(r"\b(?:https?|ftp)://[^\s)\]>`'\"]+|\bmailto:\S+|\bwww\.[\w-]+\.\w+")
BARE_PARENT = re.compile(r"(?<![\w./])(?:\.\./)+[^\s`'\")\]]*")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _pages() -> list[tuple[str, Path, str]]:
    """`(label, directory links resolve from, markdown text)` for every page a user reads."""
    pages = [(p.relative_to(ROOT).as_posix(), p.parent, p.read_text()) for p in _markdown()]
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        text = "\n\n".join(
            "".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown"
        )
        pages.append((notebook.relative_to(ROOT).as_posix(), notebook.parent, text))
    return pages


def _markdown() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """A heading's `#anchor` as GitHub spells it: lower case, punctuation other than '-' and
    '_' dropped, each space a '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (lines starting with `#` outside code blocks)."""
    return {slug(h) for h in re.findall(r"^#{1,6} (.*?)#*$", FENCE.sub("", text), re.M)}


def link_targets(text: str) -> list[str]:
    """Every link target of a page: inline links and images, reference definitions, addresses
    and bare `../` paths written anywhere (code spans too: a user follows those by hand)."""
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text) + URL.findall(text)
    return targets + BARE_PARENT.findall(INLINE_LINK.sub("", text))


def leaving(directory: Path, text: str) -> list[str]:
    """The targets of `text` (a page in `directory`) that leave the repository or name nothing
    in it, each with why."""
    bad = []
    for target in dict.fromkeys(link_targets(text)):
        if re.match(r"[a-z][\w+.-]*:|www\.", target, re.I):  # http:, mailto:, www.
            if not (ALLOWED_URLS and target.startswith(ALLOWED_URLS)):
                bad.append(f"{target}: an address outside the repository")
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor and anchor not in anchors(text):
                bad.append(f"{target}: no such heading on this page")
            continue
        resolved = (directory / path).resolve()
        if not resolved.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository ({resolved})")
        elif not resolved.exists():
            bad.append(f"{target}: no such file or directory in the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {path}")
    return bad


def test_no_page_links_outside_the_repository():
    pages = _pages()
    assert {label for label, _, _ in pages} >= {"README.md", "docs/numerics.md"}
    assert any(label.endswith(".ipynb") for label, _, _ in pages), "the notebooks are read too"
    bad = {label: found for label, directory, text in pages if (found := leaving(directory, text))}
    assert not bad, bad


@pytest.mark.parametrize(
    "text, reason",
    [
        ("The contract is [`SPEC.md`](../shared/SPEC.md).", "outside the repository"),
        ("described in `../shared/reference/`: a C++ library", "outside the repository"),
        ("[SPEC](../../shared/SPEC.md)", "outside the repository"),
        ("see [uv](https://docs.astral.sh/uv/)", "an address outside"),
        ("see <https://example.org/x> or www.example.org", "an address outside"),
        ("[gone](docs/no-such-page.md)", "no such file"),
        ("[gone](docs/training.md#no-such-heading)", "no heading"),
        ("[here](#nowhere)\n\n# Somewhere\n", "no such heading on this page"),
        ("[ref]: ../shared/SPEC.md\n", "outside the repository"),
        ("[x](#not-a-heading)\n```bash\n# not a heading\n```\n", "no such heading"),
    ],
)
def test_the_check_catches_a_link_that_leaves(text, reason):
    """Each way a page could point outside its clone, written into a page at the root."""
    found = leaving(ROOT, text)
    assert found and all(reason in line for line in found), found


def test_the_check_passes_links_that_stay():
    text = "[guide](docs/training.md#training), [code](lmjax/data/), [top](#top)\n\n# Top\n"
    assert leaving(ROOT, text) == []
    assert leaving(ROOT / "docs", "[back](../README.md#the-two-commands), ../configs/") == []
