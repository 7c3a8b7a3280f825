"""When jax's own coordination service aborts a survivor after a peer dies: the window, in
multiples of jax's heartbeat timeout T, that lmjax's watchdog must beat (issue 45, item 3).

    python benchmarks/jax_heartbeat_window.py                   # T = 4 s, 8 kills
    python benchmarks/jax_heartbeat_window.py --timeout 12 --kills 5

Two processes of plain jax (no lmjax): `jax.distributed.initialize` on 127.0.0.1 with
`heartbeat_timeout_seconds=T`, both then idle. Process 1 is SIGKILLed at delays spread evenly
over one T after both are up; the seconds until process 0 ends are taken from the kill. jax's
agent beats every T/2 and its service declares a task dead once T has passed since its last
beat (checked about once a second), so the abort comes between about T/2 and T after the
death, depending on where in the beat period the death fell (measured at T = 4: 3.0 to 5.1 s
on jax 0.10.2 and 0.12; at T = 12: 8.2 to 12.2 s on 0.10.2). lmjax declares a peer lost S
seconds after its last beat of its own (`LMJAX_HEARTBEAT_TIMEOUT=S`, beats every S/10): to
come first with a margin, T/2 must exceed S by a clear part of S, hence T = 4 S
(`lmjax.parallel.multihost.JAX_HEARTBEAT_FACTOR`). With T = 2 S, as before, the two fell
together and jax won sometimes (a CI run: aborted 6.6 s after the kill, with S = 6).

JSON (benchmarks/results/jax_heartbeat_window.json): per kill its delay, the survivor's status
and seconds; `min_fraction` and `max_fraction` of T over the kills.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

OUTPUT = Path(__file__).resolve().parent / "results" / "jax_heartbeat_window.json"

# One process: up, then idle until killed or aborted by jax.
PROGRAM = r"""
import sys, time, jax
address, count, rank, timeout = sys.argv[1], 2, int(sys.argv[2]), int(sys.argv[3])
jax.distributed.initialize(address, count, rank, heartbeat_timeout_seconds=timeout)
print("up", flush=True)
time.sleep(10**6)
"""


def one_kill(timeout_s: int, delay_s: float) -> dict:
    """Start two processes, kill process 1 `delay_s` after both are up, and time process 0."""
    address = f"127.0.0.1:{H.free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROGRAM, address, str(rank), str(timeout_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        for rank in range(2)
    ]
    try:
        for proc in procs:
            proc.stdout.readline()
        time.sleep(delay_s)
        procs[1].kill()
        killed = time.monotonic()
        try:
            status = procs[0].wait(timeout=3 * timeout_s + 10)
        except subprocess.TimeoutExpired:
            status = None  # jax never acted: counted, then ended below
        seconds = time.monotonic() - killed
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return {"delay_s": round(delay_s, 2), "status": status, "seconds": round(seconds, 2)}


def main(argv=None) -> dict:
    ap = H.parser(__doc__)
    ap.add_argument("--timeout", type=int, default=4, help="jax's heartbeat timeout T, seconds")
    ap.add_argument("--kills", type=int, default=8, help="kills, spread evenly over one T")
    H.add_output(ap, OUTPUT, "the JSON result")
    args = ap.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = ["python benchmarks/jax_heartbeat_window.py", *given]
    import jax  # the version only; the processes import their own

    result = {"machine": H.machine(load_before=H.load_average(), jax=jax.__version__),
              "timeout_s": args.timeout, "command": " ".join(command), "kills": []}  # fmt: skip
    for k in range(args.kills):
        result["kills"].append(one_kill(args.timeout, args.timeout * k / args.kills))
        print(result["kills"][-1], flush=True)
    seen = [kill["seconds"] / args.timeout for kill in result["kills"]]
    result["min_fraction"], result["max_fraction"] = round(min(seen), 3), round(max(seen), 3)
    result["all_aborted"] = all(kill["status"] == -signal.SIGABRT for kill in result["kills"])
    result["machine"]["load_after"] = H.load_average()
    H.write_result(args.output, result)
    return result


if __name__ == "__main__":
    main()
