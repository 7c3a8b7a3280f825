"""`lmjax eval RUN --tasks a,b`: a run scored on lm-evaluation-harness tasks through
`lmjax.eval_harness`, printing the harness's table (and its JSON with --output).

lm_eval is optional (`pip install 'lmjax[eval]'`): without it, one line says so. A task's data
comes from the Hugging Face hub or its cache (`HF_HUB_OFFLINE=1` reads only the cache); data
that is in neither is one line too, naming the task. `--include-path DIR` adds task YAMLs
(local jsonl files, for instance) to the harness's own.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
from pathlib import Path

from lmjax.errors import ConfigError, FileFormatError, LMJaxError

INSTALL = "pip install 'lmjax[eval]'"
# The flags that only mean something with --tasks, and those only without (eval's own).
TASK_FLAGS = ("num_fewshot", "limit", "include_path", "output")
LOSS_FLAGS = ("batches", "seq_len")


def add_task_flags(parser: argparse.ArgumentParser) -> None:
    """`lmjax eval`'s harness flags (`--batch-size` is shared with the validation loss)."""
    parser.add_argument(
        "--tasks",
        default=None,
        metavar="A,B",
        help="lm-evaluation-harness tasks, comma-separated (e.g. hellaswag,arc_easy): score "
        "the run on them instead of printing its validation loss (needs pip install "
        "'lmjax[eval]')",
    )
    parser.add_argument("--num-fewshot", type=int, default=None, help="--tasks: few-shot examples")
    parser.add_argument(
        "--limit", type=float, default=None, help="--tasks: at most this many documents a task "
        "(a fraction if below 1)"
    )  # fmt: skip
    parser.add_argument(
        "--include-path", default=None, metavar="DIR", help="--tasks: a directory of task YAMLs"
    )
    parser.add_argument("--output", default=None, help="--tasks: also write the results as JSON")


def check_flags(args: argparse.Namespace) -> None:
    """The flags of one mode only: a harness flag without --tasks, or a loss flag with it, is
    refused (it would be ignored)."""
    wrong = LOSS_FLAGS if args.tasks else TASK_FLAGS
    for name in wrong:
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            expected = "no --tasks" if args.tasks else "--tasks"
            fix = f"drop {flag}" if args.tasks else "add --tasks A,B"
            raise ConfigError.describe(flag, getattr(args, name), f"used with {expected}", fix)


def run_tasks(args: argparse.Namespace) -> int:
    from lmjax.cli.common import check_output_file

    if args.output:
        check_output_file(args.output)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not names:
        raise ConfigError.describe("--tasks", args.tasks, "task names", "pass --tasks hellaswag")
    evaluator, tasks, utils = _harness()
    manager = _task_manager(tasks, args.include_path, names)
    from lmjax.eval_harness import LMJaxLM

    lm = LMJaxLM(run=args.run_path, step=args.step, batch_size=args.batch_size or 8)
    try:
        results = evaluator.simple_evaluate(
            model=lm, tasks=names, num_fewshot=args.num_fewshot, limit=args.limit,
            task_manager=manager, log_samples=False, torch_random_seed=None,
        )  # fmt: skip
    except ConnectionError as err:  # datasets: the hub unreachable, the data not cached
        raise FileFormatError.describe(
            f"the data of --tasks {args.tasks}", str(err).splitlines()[0],
            "a task whose dataset is in the Hugging Face cache (or the hub reachable)",
            "run once online (HF_HUB_OFFLINE unset) to cache it, or use --include-path with "
            "local files",
        ) from None  # fmt: skip
    print(utils.make_table(results))
    if results.get("groups"):
        print(utils.make_table(results, "groups"))
    if args.output:
        from lmjax.files import atomic_write_text

        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(results, indent=2, default=utils.handle_non_serializable)
        atomic_write_text(args.output, text + "\n")  # whole or not at all, as lmjax's files
        print(f"wrote {args.output}")
    return 0


def _harness():
    """lm_eval's evaluator, tasks and utils modules; one line naming the install without it."""
    try:
        import lm_eval.evaluator
        import lm_eval.tasks
        import lm_eval.utils
    except ImportError as err:
        raise LMJaxError(
            f"--tasks needs lm-evaluation-harness, which is not installed ({err}). Fix: {INSTALL}"
        ) from None
    return lm_eval.evaluator, lm_eval.tasks, lm_eval.utils


def _task_manager(tasks, include_path: str | None, names: list[str]):
    """The harness's task index: --include-path's YAMLs alone when they hold every named task
    (indexing the harness's own thousands takes seconds), else with them; an unknown name is
    one line."""
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ConfigError.describe(
                "--include-path", include_path, "a directory of task YAMLs", "check the path"
            )
        local = tasks.TaskManager(include_path=include_path, include_defaults=False)
        if set(names) <= set(local.all_tasks):
            return local
    manager = _full_index(tasks, include_path)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ConfigError.describe(
                "--tasks", name, f"a task, group or tag lm_eval knows{hint}",
                "list them with `lm_eval ls tasks`, or add --include-path DIR",
            )  # fmt: skip
    return manager


@functools.lru_cache(maxsize=4)
def _full_index(tasks, include_path: str | None):
    """The harness's own task index with --include-path's (seconds to build: kept for a
    second call in one process, as a notebook or the tests make)."""
    return tasks.TaskManager(include_path=include_path)
