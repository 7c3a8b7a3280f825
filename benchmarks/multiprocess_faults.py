"""Dead and hung processes of a two-process run, each case repeated: every survivor stops with
one line in a bounded time, the newest complete checkpoint loads, and `--resume` on two new
processes ends bit for bit at the uninterrupted run (issue 45, item 3).

    python benchmarks/multiprocess_faults.py              # 10 repetitions of each case
    python benchmarks/multiprocess_faults.py --reps 1     # one of each (about 2 minutes)

Two processes x 2 CPU devices (jax.distributed on 127.0.0.1, gloo collectives), a 1-layer
Llama, `data=2,fsdp=2`, a checkpoint every step. A reference run of STEPS steps is trained once;
each repetition resumes its checkpoint 2 in two new processes and, once checkpoint 3 is complete:

    worker_killed       SIGKILL process 1
    coordinator_killed  SIGKILL process 0 (it hosts jax's coordination service)
    rank_stopped        SIGSTOP process 1 (alive but never scheduled: its heartbeats stop too)
    rank_hung           process 1 hangs reading the batch of step 5 (`HANG_AT=1:4`, 0-based:
                        benchmarks/_multiprocess.py), alive and heart-beating; no signal

with LMJAX_HEARTBEAT_TIMEOUT=HEARTBEAT_S and LMJAX_STEP_TIMEOUT=STEP_S. A survivor still running
BOUND_S after the fault is a hang (then killed). After each: the exit statuses, each survivor's
last stderr line, whether it names the lost process and a step, seconds from the fault to the
last exit, whether the newest checkpoint loads, and `--resume` (two new processes, to STEPS):
whether its final parameters and the losses it logged equal the reference's bit for bit.

JSON (benchmarks/results/multiprocess_faults.json): per case the repetitions, `hangs`, the exit
statuses seen, `named` (lines naming the process and a step), `max_s`, `checkpoint_loads`,
`resumed_equal`, and the lines of the first repetition; what failed, per repetition.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import _harness as H  # noqa: E402
import _multiprocess as P  # noqa: E402

OUTPUT = Path(__file__).parent / "results" / "multiprocess_faults.json"
STEPS, BATCH, HEARTBEAT_S, STEP_S = 8, 8, 6, 8
BOUND_S = 3 * HEARTBEAT_S + STEP_S + 10  # the longest a survivor may take after the fault
QUIET = ["logging.sample_tokens=0", "logging.plot=false", "train.eval_every=1000"]
CASES = ("worker_killed", "coordinator_killed", "rank_stopped", "rank_hung")
# What the line of the survivor (rank) must name: the lost process and a step. For a killed
# coordinator jax may abort the survivor itself (status 134): then the line is its witness's
# (lmjax.parallel.witness), written just after the process ended.
NAMES = {
    "worker_killed": {0: ("process 1 of 2", "step")},
    "coordinator_killed": {1: ("process 0", "step")},
    "rank_stopped": {0: ("process 1 of 2", "step")},
    "rank_hung": {0: ("process 1 of 2", "step"), 1: ("this process (1 of 2)", "step")},
}


def reference(root: Path) -> P.Run:
    """The uninterrupted two-process run of STEPS steps (prepared corpus and config in root)."""
    text = "To be, or not to be, that is the question: whether tis nobler in the mind\n"
    (root / "corpus.txt").write_text(text * 60)
    from lmjax.data import prepared

    prepared.prepare(str(root / "corpus.txt"), root / "data", tokenizer="char", progress=False)
    config = P.CONFIG.format(
        corpus=root / "corpus.txt", data=root / "data", steps=STEPS, batch=BATCH
    )
    (root / "c.yaml").write_text(config)
    return P.Run(root, "reference", 2, 2, [str(root / "c.yaml"), *QUIET]).finish()


def inject(run: P.Run, case: str) -> float:
    """Wait for checkpoint 3, then the fault; its time (monotonic)."""
    run.wait_for_checkpoint(3)
    fault = {"worker_killed": (1, signal.SIGKILL), "coordinator_killed": (0, signal.SIGKILL),
             "rank_stopped": (1, signal.SIGSTOP)}.get(case)  # fmt: skip
    if fault is not None:
        run.procs[fault[0]].send_signal(fault[1])
    return time.monotonic()


def survivors_end(run: P.Run, case: str, at: float) -> dict:
    """Wait (at most BOUND_S after the fault) for every process not signalled; their codes."""
    watched = [1] if case == "coordinator_killed" else [0] if case != "rank_hung" else [0, 1]
    codes, hung = {}, []
    for rank in watched:
        try:
            codes[rank] = run.procs[rank].wait(timeout=max(at + BOUND_S - time.monotonic(), 0.1))
        except Exception:  # noqa: BLE001  (subprocess.TimeoutExpired: a hang)
            hung.append(rank)
    seconds = time.monotonic() - at
    P.kill_all()  # the stopped or hung process, and a survivor that hung
    return {"codes": codes, "hung": hung, "seconds": round(seconds, 2)}


def resume_equal(root: Path, name: str, ref: P.Run) -> bool:
    """`--resume` in two new processes to STEPS: final parameters and logged losses equal."""
    import jax
    import numpy as np

    (root / f"{name}.logs").rename(root / f"{name}.fault.logs")
    args = [str(root / "c.yaml"), "--resume", *QUIET]
    run = P.Run(root, name, 2, 2, args).finish()
    mine, theirs = run.metrics(), ref.metrics()
    same_losses = all(mine[s]["loss"] == theirs[s]["loss"] for s in range(1, STEPS + 1))
    leaves = zip(
        jax.tree.leaves(run.params(STEPS)), jax.tree.leaves(ref.params(STEPS)), strict=True
    )
    return same_losses and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in leaves)


def repetition(root: Path, ref: P.Run, case: str, rep: int) -> dict:
    from lmjax.train.checkpoint import Checkpoints
    from lmjax.train.runs import load_run

    name = f"{case}-{rep}"
    P.resumed_copy(ref.dir, root / name, 2)
    env = {"LMJAX_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S), "LMJAX_STEP_TIMEOUT": str(STEP_S)}
    if case == "rank_hung":
        env["HANG_AT"] = "1:4"
    run = P.Run(root, name, 2, 2, [str(root / "c.yaml"), "--resume", *QUIET], env=env)
    out = survivors_end(run, case, inject(run, case))
    out["lines"] = {
        rank: run.last_line(rank, 3.0 * (code < 0)) for rank, code in out["codes"].items()
    }
    out["named"] = all(
        all(w in out["lines"].get(rank, "") for w in words) for rank, words in NAMES[case].items()
    )
    latest = Checkpoints(run.dir / "checkpoints", create=False).latest_step()
    out["latest_step"] = latest
    out["checkpoint_loads"] = load_run(run.dir).step == latest
    out["resumed_equal"] = resume_equal(root, name, ref)
    shutil.rmtree(root / name, ignore_errors=True)
    return out


def summary(reps: list[dict]) -> dict:
    codes = {}
    for r in reps:
        for code in r["codes"].values():
            codes[str(code)] = codes.get(str(code), 0) + 1
    return {
        "reps": len(reps),
        "hangs": sum(len(r["hung"]) for r in reps),
        "exit_codes": codes,
        "named": sum(r["named"] for r in reps),
        "max_s": max((r["seconds"] for r in reps), default=None),
        "checkpoint_loads": sum(r["checkpoint_loads"] for r in reps),
        "resumed_equal": sum(r["resumed_equal"] for r in reps),
        "first_lines": reps[0]["lines"] if reps else {},
    }


def main(argv=None) -> dict:
    ap = H.parser(__doc__)
    ap.add_argument("--reps", type=int, default=10, help="repetitions of each case")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    H.add_output(ap, OUTPUT, "the JSON result")
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    command = [
        "python benchmarks/multiprocess_faults.py",
        *(sys.argv[1:] if argv is None else argv),
    ]
    result = {"machine": H.machine(load_before=H.load_average()), "steps": STEPS,
              "heartbeat_s": HEARTBEAT_S, "step_timeout_s": STEP_S, "bound_s": BOUND_S,
              "command": " ".join(command)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="lmjax-faults-") as tmp:
        root = Path(tmp)
        try:
            ref = reference(root)
            runs = {case: [] for case in cases}
            for rep in range(args.reps):
                for case in cases:
                    runs[case].append(repetition(root, ref, case, rep))
                    result["cases"] = {c: summary(r) for c, r in runs.items()}
                    result["runs"] = runs
                    H.write_result(args.output, result)  # as it goes: a stopped campaign counts
                    print(case, rep, json.dumps(runs[case][-1]["codes"]), flush=True)
        finally:
            P.kill_all()
    result["machine"]["load_after"] = H.load_average()
    H.write_result(args.output, result)
    print(json.dumps(result["cases"], indent=1))
    return result


if __name__ == "__main__":
    main()
