"""The documentation stands on its own: what a user's clone holds is all it points to.

- Every link in README.md, docs/*.md and the notebooks' markdown cells stays in the
  repository: a relative target resolves to a file or directory inside the checkout (a
  `#heading` after a markdown file names one of its headings), and so does any bare `../` path
  written in the text. The contract and the reference documents lie beside the checkout, not in
  it, so a link to them would break in every clone.
- No absolute http(s) address at all (`ALLOWED_URLS` is empty): outside projects are named in
  words, as the README's peers are, so no page rots when someone else's site moves.
- docs/architecture.md cannot drift from the code: its layer table has one row per tier of
  `LAYERS` (tests/test_architecture.py), top to bottom, naming exactly that tier's packages; every
  repository path it names exists; every dotted `lmjax.` name is a module or a name bound in one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_architecture import LAYERS

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# Outside addresses a page may link to. Empty on purpose (issue 35: the docs never link outside
# the repository); an entry needs a reason a user cannot do without the link.
ALLOWED_URLS: tuple[str, ...] = ()

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
URL = re.compile(r"\b(?:https?|ftp)://[^\s)\]>`'\"]+|\bmailto:\S+|\bwww\.[\w-]+\.\w+")
BARE_PARENT = re.compile(r"(?<![\w./])(?:\.\./)+[^\s`'\")\]]*")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:lmjax|tests|pallas_kernels|configs|docs|benchmarks|scripts|notebooks)"
    r"/[\w./*-]*[\w*/])"
)
DOTTED = re.compile(r"`(lmjax(?:\.\w+)+)`")
# How a module binds a name: def, class, assignment, or an import (one line or a parenthesised
# list, one name a line).
BOUND = r"^(?:def|class) {name}\b|^{name}\s*[:=]|^(?:from|import) .*\b{name}\b|^\s+{name},$"


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
    assert {label for label, _, _ in pages} >= {"README.md", "docs/architecture.md"}
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


def layer_rows(text: str) -> list[set[str]]:
    """The packages each row of a page's '## The layers' table names (first column), in order."""
    match = re.search(r"^## The layers\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, "docs/architecture.md has a '## The layers' section"
    rows = [line for line in match.group(1).splitlines() if line.startswith("|")][2:]
    return [
        set(re.findall(r"`((?:lmjax|pallas_kernels)[\w.]*)`", row.split("|")[1])) for row in rows
    ]


def test_architecture_layer_table_is_the_layering_rule():
    """One table row per tier of `LAYERS`, top tier first, naming exactly its packages."""
    assert layer_rows(ARCHITECTURE.read_text()) == [set(tier) for tier in reversed(LAYERS)]


def test_a_layer_table_that_drifted_fails():
    rows = layer_rows(ARCHITECTURE.read_text())
    swapped = ARCHITECTURE.read_text().replace("| `lmjax.data` |", "| `lmjax.data`, `lmjax.lora` |")
    assert layer_rows(swapped) != rows


def _module_file(dotted: str) -> Path | None:
    base = ROOT / Path(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def unknown_names(text: str) -> list[str]:
    """Repository paths (`lmjax/...`, `tests/...`, globs too) that match no file or directory,
    and backquoted `lmjax.x.y` that are neither a module nor a name bound in the longest module
    that prefixes them."""
    unknown = [p for p in sorted(set(REPO_PATH.findall(text))) if not any(ROOT.glob(p.rstrip("/")))]
    for name in sorted(set(DOTTED.findall(text))):
        parts = name.split(".")
        k = max(i for i in range(1, len(parts) + 1) if _module_file(".".join(parts[:i])))
        source = _module_file(".".join(parts[:k])).read_text()
        if k < len(parts) and not re.search(BOUND.format(name=parts[k]), source, re.M):
            unknown.append(name)
    return unknown


def test_architecture_names_only_what_exists():
    text = ARCHITECTURE.read_text()
    assert len(REPO_PATH.findall(text)) >= 20 and len(DOTTED.findall(text)) >= 10
    assert unknown_names(text) == []


def test_a_name_that_moved_fails():
    text = "`lmjax/train/data.py`, `lmjax.train.loop.no_such_function`, `tests/test_nothing*.py`"
    text += ", `lmjax.data.prepared.prepare`, `lmjax/data/`"
    assert unknown_names(text) == [
        "lmjax/train/data.py",
        "tests/test_nothing*.py",
        "lmjax.train.loop.no_such_function",
    ]


# The contract's own file is not in the repository: a docstring or an error message that sends
# the reader to "SPEC section 6" or ../shared points at nothing. (PartitionSpec and friends are
# other words: the pattern wants SPEC on its own.)
OUTSIDE_REFERENCE = re.compile(r"\bSPEC\b|\.\./shared|shared/reference")


def outside_references(root: Path = ROOT) -> list[str]:
    """`path:line` of each mention of the contract file in lmjax/ and pallas_kernels/."""
    found = []
    for package in ("lmjax", "pallas_kernels"):
        for path in sorted((root / package).rglob("*.py")):
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if OUTSIDE_REFERENCE.search(line):
                    found.append(f"{path.relative_to(root)}:{i}")
    return found


def test_the_library_sends_no_reader_outside_the_repository():
    assert outside_references() == []


def test_the_library_check_catches_a_spec_reference(tmp_path):
    (tmp_path / "lmjax").mkdir()
    (tmp_path / "pallas_kernels").mkdir()
    (tmp_path / "lmjax" / "a.py").write_text('"""Models (SPEC section 3)."""\nP = PartitionSpec\n')
    (tmp_path / "pallas_kernels" / "b.py").write_text("# see ../shared/reference/\n")
    assert outside_references(tmp_path) == ["lmjax/a.py:1", "pallas_kernels/b.py:1"]
