"""Random kills: real `lmjax train` processes SIGKILLed after seeded random delays, resumed until
each run completes; every completed run must end bit for bit at the uninterrupted run.

    python benchmarks/random_kills.py --kills 1000          # 5-8 s of wall per kill (below)
    python benchmarks/random_kills.py --kills 10 --quick    # the suite's version

Each run is the tiny run of `benchmarks/_kills.py` (a checkpoint every step, keeping 2, an
evaluation every 3 steps, TensorBoard on). A run is started, killed after a delay drawn
uniformly from [0, 1.2 x the uninterrupted run's wall time] (seeded), started again with
`--resume` (afresh when the kill came before its directory held anything: `--resume` of
nothing is refused, so that a mistyped run.dir never starts a new run), and so on until a
start runs to the end (after `--max-kills-per-run` kills the run is let finish). Then its
final state and logged losses are compared with the uninterrupted run's, and its directory
searched for temporaries. The JSON (written after every run, so a
campaign stopped early still records what it did):

    kills, kills_in_a_save (a save's temporary or dropped step was on disk after the kill),
    runs, failed_restores (a resume that exited non-zero), runs_differing (final state or
    losses), temporaries_left (names found in completed runs); target 0, 0, 0, 0.

Cost: 2.7 s of wall per kill for seed 2 on 2 CPUs, a fuzz campaign beside it (2026-12-07: 1,000
kills in 45 min); 8.2 and 5.4 s for seeds 0 and 1 run side by side on a busier machine.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _kills as K  # noqa: E402

OUTPUT = Path(__file__).parent / "results" / "random_kills.json"


def campaign(root: Path, kills: int, seed: int, max_per_run: int, output: Path | None) -> dict:
    env = K.workspace(root)
    reference = root / "reference"
    assert K.run_to_end(root, env, reference, resume=False) == 0, "the uninterrupted run failed"
    wall, code = H.timed(lambda: K.run_to_end(root, env, root / "timed", resume=False))
    assert code == 0
    ref = K.Reference(reference)
    rng = random.Random(seed)
    result = {
        "kills": 0, "kills_in_a_save": 0, "runs": 0, "failed_restores": 0,
        "runs_differing": 0, "temporaries_left": 0,
        "seed": seed, "kills_asked": kills, "delay_range_s": [0.0, round(1.2 * wall, 3)],
        "uninterrupted_run_s": round(wall, 3), "failures": [],
        "machine": H.machine(), "load_average_before": H.load_average(),
    }  # fmt: skip
    began = time.perf_counter()
    while result["kills"] < kills:
        run = root / f"run{result['runs']}"
        _one_run(root, env, run, rng, wall, min(max_per_run, kills - result["kills"]), result)
        differs = K.Reference.differences(ref, run)
        left = K.temporaries(run)
        result["runs"] += 1
        result["runs_differing"] += bool(differs)
        result["temporaries_left"] += len(left)
        if differs or left:
            result["failures"].append({"run": run.name, "differs": differs, "left": left})
        shutil.rmtree(run, ignore_errors=True)
        result["wall_s"] = round(time.perf_counter() - began, 1)
        result["load_average_after"] = H.load_average()
        if output is not None:
            output.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _one_run(root, env, run: Path, rng: random.Random, wall: float, budget: int, result: dict):
    """Start, kill and resume `run` until it completes; at most `budget` kills."""
    resume, killed = False, 0
    while True:
        if killed < budget:
            code = K.kill_after(root, env, run, resume, rng.uniform(0.0, 1.2 * wall))
        else:
            code = K.run_to_end(root, env, run, resume)
        if code == 0:
            return
        if code != -9:  # a start that failed by itself: a restore that failed
            result["failed_restores"] += 1
            log = (run.parent / f"{run.name}.log").read_text()[-1500:]
            result["failures"].append({"run": run.name, "exit": code, "log": log})
            return
        else:
            killed += 1
            result["kills"] += 1
            result["kills_in_a_save"] += K.in_a_save(run)
        resume = K.started(run)


def main(argv=None) -> int:
    ap = H.parser(__doc__)
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-kills-per-run", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    ap.add_argument("--quick", action="store_true", help="do not write the results file")
    H.add_output(ap, None, f"JSON path (default {OUTPUT}; none with --quick)")
    args = ap.parse_args(argv)
    output = args.output or (None if args.quick else OUTPUT)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        result = campaign(root, args.kills, args.seed, args.max_kills_per_run, output)
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}, indent=2))
    for failure in result["failures"][:5]:
        print(json.dumps(failure)[:2000], file=sys.stderr)
    bad = ("failed_restores", "runs_differing", "temporaries_left")
    return 1 if any(result[k] for k in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
