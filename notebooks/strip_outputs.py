"""Strip outputs, execution counts and run metadata from notebooks, as the repository keeps them.

    .venv/bin/python notebooks/strip_outputs.py            # every notebooks/*.ipynb, in place
    .venv/bin/python notebooks/strip_outputs.py --check    # exit 1 naming any notebook with outputs
    .venv/bin/python notebooks/strip_outputs.py a.ipynb    # just these files

`make strip-notebooks` runs the first form. `tests/test_notebooks.py` fails on a committed
notebook that still carries outputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
# Written by a run (nbclient timings, Jupyter UI state), not by the author.
RUN_CELL_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")


def strip(nb: nbformat.NotebookNode) -> bool:
    """Strip `nb` in place; True when anything changed."""
    before = nbformat.writes(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in RUN_CELL_METADATA:
            cell.metadata.pop(key, None)
    nb.metadata.pop("widgets", None)
    if "language_info" in nb.metadata:  # the version and codemirror details vary by machine
        nb.metadata.language_info = {"name": nb.metadata.language_info.get("name", "python")}
    return nbformat.writes(nb) != before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    parser.add_argument("--check", action="store_true", help="report, do not rewrite")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(HERE.glob("*.ipynb"))
    dirty = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if strip(nb):
            dirty.append(path)
            if not args.check:
                nbformat.write(nb, path)
    for path in dirty:
        print(f"{path}: {'has outputs' if args.check else 'stripped'}")
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())
