"""Every kill point of a save: each file-system operation of `lmjax train`'s start and of one
checkpoint save (with its commit, the drop of the oldest kept step, the metrics, evaluation and
TensorBoard records around it), listed with strace, and a real run SIGKILLed right before each.

    python benchmarks/kill_points.py                 # every point: about 12 s of CPU a point
    python benchmarks/kill_points.py --points 3      # a few, evenly spread (the suite's)

1. Record: the tiny run of `benchmarks/_kills.py` runs once under
   `strace -f -y -e trace=<every call that creates, writes, syncs, renames or removes>`; the
   calls on paths inside the run directory are kept, in order, with the run directory written
   RUN (`--record FILE` writes them; benchmarks/results/kill_points_strace.txt is one).
2. Points: the calls of the start (before the first checkpoint) and of the save of step 3 (it
   drops step 1 and is followed by an evaluation) up to the first call of the save of step 4.
   Each distinct (call, path) is a point, and each repetition of it where strace can count it.
   A path with a random part (tensorstore's data files, `.NAME.<16 hex>.tmp`, the TensorBoard
   file) cannot be named in advance: those calls are listed, and killed at the next call on a
   path that can (`targetable` false in the JSON).
3. Kill: a new run under `strace -f -P PATH -e inject=CALL:signal=KILL:when=N`: strace SIGKILLs
   the process as the N-th such call on PATH starts, so it and everything after it never
   happen; a kill before the next call is a kill after this one. strace counts calls per
   thread, so N > 1 is used only where one thread makes every such call; with several threads
   writing (tensorstore) the first is the first of the thread that gets there first.
4. Check: `--resume` (and, when the run never wrote config.yaml, a fresh start on a copy) runs
   to the end; the final state equals the uninterrupted run's bit for bit, the logged
   (step, loss, val_loss) are the same, nothing temporary is left.

The JSON: per point the call, the path, whether the kill landed, the steps on disk after it,
and the checks; totals `points`, `killed`, `failed` (target 0).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as H  # noqa: E402
import _kills as K  # noqa: E402

OUTPUT = Path(__file__).parent / "results" / "kill_points.json"
RECORD = Path(__file__).parent / "results" / "kill_points_strace.txt"
STRACE = "strace"
CALLS = (
    "mkdir,mkdirat,open,openat,creat,write,pwrite64,writev,pwritev,sendfile,copy_file_range,"
    "fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat,rmdir,ftruncate"
)
WRITING_OPEN = ("O_WRONLY", "O_RDWR", "O_CREAT")
RANDOM = re.compile(r"[0-9a-f]{32}|\.[0-9a-f]{16}\.tmp|events\.out\.tfevents\.")
LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)$")
FD_PATH = re.compile(r"^-?\d+<([^>]*)>")
STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
WINDOW_STEP = 3  # the save whose calls are points: it drops step 1, an evaluation follows


def record(root: Path, env: dict, run: Path, trace: Path) -> list[dict]:
    """The calls that change files inside `run`, from a traced uninterrupted run, in order."""
    cmd = K.train_command(run, False, (STRACE, "-f", "-y", "-qq", "-o", str(trace),
                                       "-e", f"trace={CALLS}"))  # fmt: skip
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = []
    for line in trace.read_text().splitlines():
        call = parse(line, str(run))
        if call is not None:
            calls.append(call)
    return calls


def parse(line: str, run: str) -> dict | None:
    """`{"call", "path", "to", "thread"}` of a strace line changing something under `run`, with
    `run` written RUN; None for anything else (a read-only open, another directory)."""
    match = LINE.match(line)
    if match is None or "resumed>" in line:
        return None
    thread, call, args = match.groups()
    if call.startswith("open") and not any(flag in args for flag in WRITING_OPEN):
        return None
    fd = FD_PATH.match(args)
    strings = STRING.findall(args)
    if fd and strings and not strings[0].startswith("/"):  # unlinkat(dirfd, name): strace
        path = fd.group(1)  # -P matches the directory's descriptor, not the relative name
    elif strings and not call.startswith(("write", "pwrite", "fsync", "fdatasync", "ftrunc")):
        path = strings[0]
    elif fd:
        path = fd.group(1)
    else:
        return None
    if not (path == run or path.startswith(run + "/")):
        return None
    to = strings[1] if call.startswith("rename") and len(strings) > 1 else None
    rel = lambda p: "RUN" + p[len(run) :]  # noqa: E731
    return {"call": call, "path": rel(path), "to": rel(to) if to else None, "thread": int(thread)}


def points(calls: list[dict], step: int = WINDOW_STEP) -> list[dict]:
    """The start's calls and the save of `step`'s (to the first call of the next save), in
    order: one point per distinct (call, path), and one per later occurrence where every
    occurrence comes from one thread (strace's count `when` is exact then)."""
    first_save = next(i for i, c in enumerate(calls) if "/checkpoints/1." in c["path"])
    begin = next(i for i, c in enumerate(calls) if f"/checkpoints/{step}." in c["path"])
    end = next(i for i, c in enumerate(calls) if f"/checkpoints/{step + 1}." in c["path"])
    out = []
    for phase, window in (("start", calls[:first_save]), (f"save {step}", calls[begin : end + 1])):
        threads, count = {}, {}
        for c in window:
            threads.setdefault((c["call"], c["path"]), set()).add(c["thread"])
        for c in window:
            key = (c["call"], c["path"])
            count[key] = count.get(key, 0) + 1
            if count[key] == 1 or len(threads[key]) == 1:
                targetable = not RANDOM.search(c["path"])
                out.append({"phase": phase, **c, "when": count[key], "targetable": targetable})
    return out


def check_point(root: Path, env: dict, point: dict, n: int, ref: K.Reference) -> dict:
    """Kill a new run before `point`'s call, then resume it (and start it afresh, where it
    never wrote config.yaml) and compare with the uninterrupted run."""
    run = root / f"point{n}"
    path = point["path"].replace("RUN", str(run), 1)
    call = point["call"]
    prefix = (STRACE, "-f", "-qq", "-o", "/dev/null", "-P", path, "-e", f"trace={call}",
              "-e", f"inject={call}:signal=KILL:when={point['when']}")  # fmt: skip
    code = K.start(root, env, run, False, prefix).wait(600)
    out = {"killed": code in (-9, 137), "exit": code}
    if not K.started(run):  # killed before the run directory held anything: start again
        out.update(left=None, checks={"fresh start": _finish(root, env, run, False, ref)})
        shutil.rmtree(run, ignore_errors=True)
        return out
    ckpts = run / "checkpoints"
    out["left"] = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    out["config_written"] = (run / "config.yaml").exists()
    fresh = None
    if not out["config_written"]:
        fresh = root / f"point{n}-fresh"
        shutil.copytree(run, fresh)
    checks = {"resume": _finish(root, env, run, True, ref)}
    if fresh is not None:
        checks["fresh start"] = _finish(root, env, fresh, False, ref)
    out["checks"] = checks
    for directory in (run, fresh):
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
    return out


def _finish(root: Path, env: dict, run: Path, resume: bool, ref: K.Reference) -> list[str]:
    """Run `run` to its end; what is wrong with the result ([] when it equals `ref`)."""
    code = K.run_to_end(root, env, run, resume)
    if code != 0:
        log = (run.parent / f"{run.name}.log").read_text()[-800:]
        return [f"exit {code}: {log}"]
    return ref.differences(run) + [f"left {name}" for name in K.temporaries(run)]


def sweep(root: Path, how_many: int | None, record_to: Path | None) -> dict:
    env = K.workspace(root)
    reference = root / "reference"
    assert K.run_to_end(root, env, reference, resume=False) == 0
    ref = K.Reference(reference)
    calls = record(root, env, root / "recorded", root / "strace.txt")
    if record_to is not None:
        record_to.write_text("".join(_record_line(c) for c in calls))
    listed = points(calls)
    targets = [p for p in listed if p["targetable"]]
    if how_many is not None and how_many < len(targets):
        step = (len(targets) - 1) / max(1, how_many - 1)
        targets = [targets[round(i * step)] for i in range(how_many)]
    results = []
    for n, point in enumerate(targets):
        results.append({**point, **check_point(root, env, point, n, ref)})
    failed = [r for r in results if any(r.get("checks", {}).values())]
    return {
        "points": len(results), "listed": len(listed),
        "killed": sum(r["killed"] for r in results), "failed": len(failed),
        "strace_calls_recorded": len(calls), "results": results,
        "untargetable": [p for p in listed if not p["targetable"]],
        "machine": H.machine(),
    }  # fmt: skip


def _record_line(call: dict) -> str:
    to = f" -> {call['to']}" if call["to"] else ""
    return f"{call['thread']:>7} {call['call']:<10} {call['path']}{to}\n"  # the thread: its id


def main(argv=None) -> int:
    ap = H.parser(__doc__)
    ap.add_argument("--points", type=int, default=None, help="how many (default: every one)")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    ap.add_argument("--record", type=Path, default=None, help=f"write the calls here ({RECORD})")
    ap.add_argument("--quick", action="store_true", help="do not write the results file")
    H.add_output(ap, None, f"JSON path (default {OUTPUT}; none with --quick)")
    args = ap.parse_args(argv)
    output = args.output or (None if args.quick else OUTPUT)
    record_to = args.record or (None if args.quick else RECORD)
    with tempfile.TemporaryDirectory() as tmp:
        result = sweep(args.workdir or Path(tmp), args.points, record_to)
    if output is not None:
        output.write_text(json.dumps(result, indent=2) + "\n")
    brief = {k: result[k] for k in ("points", "listed", "killed", "failed")}
    print(json.dumps(brief))
    for r in result["results"]:
        print(f"{r['phase']:<7} {r['call']:<9} {r['path']:<70} killed={r['killed']} "
              f"{'ok' if not any(r.get('checks', {}).values()) else r['checks']}")  # fmt: skip
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
