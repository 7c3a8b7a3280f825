"""One `lmjax compile` row of compile_time.py in a process of its own, with the lmjax that
PYTHONPATH gives: this checkout's, or a baseline checkout's (`--baseline-tree`), whose
`compile_train_step` may predate `count_layers`. Prints one JSON line.

    PYTHONPATH=DIR python benchmarks/_tpu_row.py CONFIG TOPOLOGY [section.field=value ...]
"""

from __future__ import annotations

import inspect
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu is installed: no TPU chip is looked for

import lmjax  # noqa: E402
from lmjax.config import load_run_config  # noqa: E402
from lmjax.train import tpu_compile  # noqa: E402


def main(config: str, topology: str, overrides: list[str]) -> dict:
    run = load_run_config(config, overrides)
    # Today's second compile (XLA FLOPs per layer) is not compile time: skip it where it exists.
    known = inspect.signature(tpu_compile.compile_train_step).parameters
    options = {"count_layers": False} if "count_layers" in known else {}
    report = tpu_compile.compile_train_step(run, topology, **options)
    return {
        "compile_s": round(report.compile_s, 2),
        "generated_code_bytes": report.memory.generated_code,
        "device_total_bytes": report.memory.total,
        "fits": report.fits,
        "lmjax": os.path.dirname(os.path.dirname(lmjax.__file__)),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])), flush=True)
