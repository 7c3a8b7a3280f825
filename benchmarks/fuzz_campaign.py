"""A fuzz campaign (issue 45, item 4): every target of fuzz/targets.py in turn, for a given time
each, on one core, coverage-guided with atheris where it is installed (fuzz/run.py); the figures
go to JSON:

    nice -n 10 python benchmarks/fuzz_campaign.py --seconds 160 \\
        --out benchmarks/results/fuzz_campaign.json

Per target: executions, seconds fuzzing (libFuzzer's count; `wall_seconds` adds each start's
imports), executions per second, coverage (libFuzzer's `cov`, edges of
the instrumented lmjax/jinja2/yaml code, and `ft`, its features) at the end, the corpus size,
the peak resident size, the findings (inputs saved under fuzz/findings/TARGET/) and
`failed_starts` (starts that ended with a non-zero status, each a finding, with the report in
`finding_output_tails`; `total_findings` counts a failed start even where no input was saved).
A finding stops libFuzzer; the campaign starts the target again for the time left. The
working corpus (FUZZ_WORK, default a fresh temporary directory) carries coverage from one start
to the next. `projected_hours_for_10M` is what 10 million executions take at the measured rate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fuzz"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # targets imports lmjax, and so jax: no TPU probe
import targets  # noqa: E402

_STATS = re.compile(r"^stat::(\w+):\s+(\d+)", re.M)
_DONE = re.compile(r"^Done (\d+) runs in (\d+) second", re.M)
_PULSE = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)", re.M)


def _one_start(target: str, seconds: float, work: Path) -> tuple[dict, str]:
    """One fuzz/run.py process; (its figures, its output)."""
    env = dict(os.environ, FUZZ_WORK=str(work), JAX_PLATFORMS="cpu")
    command = [sys.executable, str(ROOT / "fuzz" / "run.py"), target]
    command += [f"-max_total_time={max(1, int(seconds))}", "-print_final_stats=1"]
    start = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    out = done.stdout + done.stderr
    stats = {k: int(v) for k, v in _STATS.findall(out)}
    pulses = _PULSE.findall(out)
    executions = stats.get("number_of_executed_units", int(pulses[-1][0]) if pulses else 0)
    wall = time.monotonic() - start
    # libFuzzer's own seconds (after the imports and their instrumentation, ~10-25 s a start)
    fuzzing = int(_DONE.findall(out)[-1][1]) if _DONE.search(out) else wall
    figures = dict(executions=executions, seconds=fuzzing, wall=wall, rc=done.returncode)
    if pulses:
        figures |= dict(cov=int(pulses[-1][1]), ft=int(pulses[-1][2]), corpus=int(pulses[-1][3]))
    figures["peak_rss_mb"] = stats.get("peak_rss_mb")
    return figures, out


def _finding_text(out: str) -> str:
    """What a failed start said about its finding: from atheris's or libFuzzer's report on (the
    report goes to stdout, libFuzzer's progress lines to stderr), else the output's end."""
    marks = [out.find(m) for m in ("=== Uncaught Python exception", "==ERROR: libFuzzer")]
    start = min((m for m in marks if m >= 0), default=max(len(out) - 3000, 0))
    return out[start : start + 3000]


def campaign(target: str, seconds: float, work: Path) -> dict:
    """`target` for `seconds` in all, restarted after each finding."""
    findings_dir = ROOT / "fuzz" / "findings" / target
    before = set(findings_dir.glob("*")) if findings_dir.exists() else set()
    total = dict(executions=0, seconds=0.0, wall_seconds=0.0, starts=0)
    total |= dict(cov=None, ft=None, corpus=None, failed_starts=0)
    rss, tails = [], []
    while total["seconds"] < seconds - 2:
        figures, out = _one_start(target, seconds - total["seconds"], work)
        total["starts"] += 1
        total["executions"] += figures["executions"]
        total["seconds"] += figures["seconds"]
        total["wall_seconds"] += figures["wall"]
        for key in ("cov", "ft", "corpus"):
            total[key] = figures.get(key, total[key])
        rss.append(figures["peak_rss_mb"] or 0)
        if figures["rc"] != 0:  # a finding, whether or not its input reached a file
            total["failed_starts"] += 1
            tails.append(f"exit status {figures['rc']}\n" + _finding_text(out))
            if total["starts"] > 20:
                break
    after = set(findings_dir.glob("*")) if findings_dir.exists() else set()
    total["exec_per_s"] = round(total["executions"] / max(total["seconds"], 1e-9), 1)
    total["seconds"] = round(total["seconds"], 1)
    total["wall_seconds"] = round(total["wall_seconds"], 1)
    total["peak_rss_mb"] = max(rss, default=None)
    total["findings"] = sorted(str(p.relative_to(ROOT)) for p in after - before)
    # libFuzzer's crash-<sha1> and fuzz/run.py's atheris-<crc32> hold the same input: count once
    total["distinct_inputs"] = len({p.read_bytes() for p in after - before})
    total["finding_output_tails"] = tails
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=160, help="per target")
    parser.add_argument("--targets", default=",".join(targets.TARGETS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/fuzz_campaign.json"))
    args = parser.parse_args()
    try:
        import atheris

        engine = f"atheris {getattr(atheris, '__version__', '')}".strip()
    except ImportError:
        engine = "fuzz/mutate.py (atheris not installed: no coverage figures)"
    work = Path(os.environ.get("FUZZ_WORK") or tempfile.mkdtemp(prefix="lmjax-fuzz-campaign-"))
    results = {}
    for target in args.targets.split(","):
        results[target] = campaign(target, args.seconds, work)
        print(target, {k: v for k, v in results[target].items() if k != "finding_output_tails"})
    executions = sum(r["executions"] for r in results.values())
    seconds = sum(r["seconds"] for r in results.values())
    report = dict(
        command=" ".join(["python", *sys.argv]),
        engine=engine,
        machine=f"{platform.machine()}, {os.cpu_count()} cores, one used; Python "
        + platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        scratch=targets.scratch() or tempfile.gettempdir(),  # where each input is written
        seconds_per_target=args.seconds,
        total_executions=executions,
        total_seconds=round(seconds, 1),
        exec_per_s=round(executions / seconds, 1),
        projected_hours_for_10M=round(1e7 / (executions / seconds) / 3600, 1),
        total_findings=sum(max(r["distinct_inputs"], r["failed_starts"]) for r in results.values()),
        targets=results,
    )
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "targets"}, indent=1))


if __name__ == "__main__":
    main()
