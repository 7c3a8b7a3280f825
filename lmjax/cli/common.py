"""What several `lmjax` commands share when they run: a run loaded at a step, a JSON report's
output file (their shared flags are in `args`).

Heavy imports stay inside the functions (they keep `lmjax --help` fast).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load_run(path, step: int | None, quantize: str | None = None):
    """`train.load_run`, refusing a step it can't honour: a weights-only run (import-hf,
    merged/) has no checkpoints, and its weights would have been used whatever --step said.
    With `quantize` (a QLoRA run's NF4 base, or --quantize nf4), a line on stderr says so."""
    from lmjax import train
    from lmjax.checks import require
    from lmjax.train.rundir import RunDir

    run = train.load_run(path, step, quantize=quantize)
    if quantize is not None:  # generate and chat say what they decode through (stderr)
        from lmjax.finetune.notes import decoding_line

        print(decoding_line(run), file=sys.stderr)
    wanted = RunDir.parse(path)[1] if step is None else step
    weights_only = " (it holds weights only, no checkpoints)" if run.step is None else ""
    require(
        wanted is None or run.step == wanted,
        "--step" if step is not None else "checkpoints/<step> in the path",
        wanted,
        f"a checkpoint step of {run.directory}{weights_only}",
        "drop --step to use the run's weights, or pass a step under checkpoints/",
    )
    return run


def check_output_file(path: str) -> None:
    """A file path a report can be written to: not a directory, under a directory (or a path
    to make one). Checked before the minutes of work, not after."""
    from lmjax.checks import require

    out = Path(path)
    ancestors = [p for p in out.parents if p.exists()]
    blocker = out if out.is_dir() else (ancestors[0] if ancestors else out)
    kind = "a directory" if blocker == out else "a file"
    require(
        not out.is_dir() and (not ancestors or ancestors[0].is_dir()),
        "--output",
        path,
        f"a file path (but {blocker} is {kind})",
        "pass a file name such as results/bench.json",
    )


def write_json(path: str, report: dict) -> None:
    """`report` as indented JSON at `path` (its parents made), and a line saying so."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
