"""The package layout's promises that an import can check (issue 35): the old home of the data
pipeline still answers for one release, with a warning, and every name the README's module
table gives a package is found there (an attribute or a submodule)."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
ROW = re.compile(r"^\| `((?:lmjax|pallas_kernels)(?:\.\w+)*)` \| (.*) \|$")
NAME = re.compile(r"`(\w+)`")  # a bare identifier in backticks: calls and paths are skipped
ASIDE = re.compile(r"\([^()]*\)")  # parentheses hold arguments and config keys, not names
LAID_OUT = ("lmjax.data", "lmjax.train", "lmjax.finetune", "lmjax.lora")  # issue 35's packages


def module_table() -> dict[str, list[str]]:
    """README's "What is in the box" rows: module -> the bare names its second cell gives."""
    rows = {}
    for line in README.read_text().splitlines():
        m = ROW.match(line)
        if m:
            cell = m.group(2)
            while ASIDE.search(cell):
                cell = ASIDE.sub("", cell)
            rows[m.group(1)] = NAME.findall(cell)
    return rows


def test_lmjax_train_data_is_lmjax_data_with_a_deprecation_warning():
    import lmjax.data
    import lmjax.train

    with pytest.warns(DeprecationWarning, match="lmjax.train.data moved to lmjax.data"):
        old = lmjax.train.data
    assert old is lmjax.data
    with pytest.warns(DeprecationWarning):
        from lmjax.train import data  # the spelling the notebooks used
    assert data.train_batch is lmjax.data.prepared.train_batch


def test_other_missing_names_of_lmjax_train_still_raise():
    import lmjax.train

    with pytest.raises(AttributeError, match="no attribute 'datas'"):
        lmjax.train.datas  # noqa: B018


def test_the_table_has_the_packages_of_the_layout():
    assert set(LAID_OUT) <= set(module_table())


@pytest.mark.parametrize("module", LAID_OUT)
def test_every_name_the_module_table_gives_is_there(module):
    m = importlib.import_module(module)
    missing = [
        n
        for n in module_table()[module]
        if not hasattr(m, n) and importlib.util.find_spec(f"{module}.{n}") is None
    ]
    assert not missing, f"README says {module} has {missing}"
