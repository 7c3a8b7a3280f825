"""Several real `lmjax train` processes of one run under `jax.distributed` on loopback: what
tests/test_multiprocess.py and benchmarks/multiprocess_faults.py share.

`Run` starts N processes of WORKER (`lmjax train`, or `finetune`, with each process's batch
rows and written paths recorded; `HANG_AT=RANK:STEP` makes that process hang, alive, reading
that step's batch), each with its own CPU devices, on a free loopback port. Every process
started is in PROCESSES, for the caller to kill at the end (`kill_all`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the device-count flags the tests' subprocesses use
sys.path.insert(0, str(ROOT / "benchmarks"))  # loaded by the tests too, not only run from there

from _harness import free_port  # noqa: E402
from _xla_flags import host_devices  # noqa: E402

RUN_LIMIT_S = 240  # one launch, compile included, on a loaded 2-core machine

CONFIG = """
model: {{preset: llama, vocab_size: null, context_length: 16, n_layers: 1}}
data: {{corpus: {corpus}, tokenizer: char, dir: {data}}}
schedule: {{warmup_steps: 1}}
train: {{steps: {steps}, batch_size: {batch}, seq_len: 8, eval_every: {steps}, eval_batches: 1}}
checkpoint: {{every: 1, keep: 100}}
logging: {{every: 1, progress: false, sample_tokens: 2, sample_prompt: T, peak_flops: 1.0e+12}}
parallel: {{mesh: "data=2,fsdp=2"}}
"""

# One process of a run: `lmjax train ARGS`, recording (in RECORD, as JSON) the batch rows each
# train_batch call read and every path under RUN it opened for writing, renamed or made.
WORKER = r"""
import json, os, sys
run, record_path, args = os.path.realpath(sys.argv[1]), sys.argv[2], sys.argv[3:]
record = {"rows": [], "writes": []}
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def mine(path):
    if isinstance(path, (str, os.PathLike)):
        path = os.path.realpath(os.fspath(path))
        if path.startswith(run + os.sep):
            record["writes"].append(os.path.relpath(path, run))

def audit(event, details):
    if event == "open" and isinstance(details[2], int) and details[2] & WRITE:
        mine(details[0])
    elif event in ("os.rename", "os.replace"):
        mine(details[1])
    elif event == "os.mkdir":
        mine(details[0])

sys.addaudithook(audit)
from lmjax import cli
from lmjax.errors import ConfigError
from lmjax.data import prepared as data

real = data.train_batch
hang = os.environ.get("HANG_AT")  # "RANK:STEP": that process hangs reading that batch (0-based)
def train_batch(tokens, seed, step, *rest):
    if hang == f"{os.environ.get('LMJAX_PROCESS_ID')}:{int(step)}":
        import time
        while True:  # alive, its heartbeats going, never reaching the step's collective
            time.sleep(1)
    rows = rest[3] if len(rest) > 3 else None
    record["rows"].append([int(step), None if rows is None else [int(r) for r in rows]])
    return real(tokens, seed, step, *rest)

data.train_batch = train_batch
code = cli.main(args)
with open(record_path, "w") as f:
    json.dump(record, f)
sys.exit(code)
"""

PROCESSES: list[subprocess.Popen] = []  # every process started here


class Run:
    """One `lmjax train` (or `verb`: finetune) over `processes` processes of `devices` CPU
    devices each."""

    def __init__(
        self, root: Path, name: str, processes: int, devices: int, args, env=None, verb="train"
    ):
        self.dir, self.logs = root / name, root / f"{name}.logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.procs = []
        for i in range(processes):
            ranks = {} if processes == 1 else {
                "LMJAX_COORDINATOR": f"127.0.0.1:{port}",
                "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",  # loopback only
                "LMJAX_NUM_PROCESSES": str(processes),
                "LMJAX_PROCESS_ID": str(i),
            }  # fmt: skip
            full_env = {
                **os.environ, "JAX_PLATFORMS": "cpu", **ranks, **(env or {}),
                "XLA_FLAGS": host_devices(devices),
            }  # fmt: skip
            with open(self.logs / f"{i}.err", "w") as err:
                command = [sys.executable, "-c", WORKER, str(self.dir), str(self.record_path(i))]
                proc = subprocess.Popen(
                    [*command, verb, *args, f"run.dir={self.dir}"],
                    cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=err,
                )  # fmt: skip
            PROCESSES.append(proc)
            self.procs.append(proc)

    def record_path(self, i: int) -> Path:
        return self.logs / f"{i}.json"

    def stderr(self, i: int) -> str:
        return (self.logs / f"{i}.err").read_text()

    def last_line(self, i: int, wait_s: float = 0.0) -> str:
        """The last line of process `i`'s stderr; with `wait_s`, waiting that long at most for
        one of lmjax's (a process killed by a signal gets its line from its witness,
        `lmjax.parallel.witness`, just after it ended)."""
        deadline = time.monotonic() + wait_s
        while True:
            lines = self.stderr(i).strip().splitlines()
            last = lines[-1] if lines else ""
            if last.startswith("lmjax train:") or time.monotonic() >= deadline:
                return last
            time.sleep(0.05)

    def wait_for_checkpoint(self, step: int, limit_s: float = RUN_LIMIT_S) -> None:
        """Wait until checkpoint `step` is on disk, every process still running (else raise)."""
        deadline = time.monotonic() + limit_s
        while not (self.dir / "checkpoints" / str(step)).is_dir():
            codes = [p.poll() for p in self.procs]
            if any(c is not None for c in codes) or time.monotonic() > deadline:
                ends = "\n".join(self.stderr(i)[-1500:] for i in range(len(self.procs)))
                raise RuntimeError(f"{self.dir.name}: {codes} before checkpoint {step}:\n{ends}")
            time.sleep(0.05)

    def wait(self, limit_s: float = RUN_LIMIT_S) -> list[int]:
        deadline = time.monotonic() + limit_s
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                for p in self.procs:
                    p.kill()
                raise TimeoutError(f"{self.dir.name}: still running after {limit_s} s") from None
        return codes

    def finish(self) -> Run:
        codes = self.wait()
        errors = [self.stderr(i)[-3000:] for i, c in enumerate(codes) if c != 0]
        assert codes == [0] * len(codes), errors
        return self

    def record(self, i: int) -> dict:
        return json.loads(self.record_path(i).read_text())

    def metrics(self) -> dict[int, dict]:
        lines = (self.dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}

    def params(self, step: int):
        from lmjax.train.runs import load_run

        return load_run(self.dir, step).params


def resumed_copy(source: Path, target: Path, step: int) -> Path:
    """A copy of a run directory whose checkpoints after `step` are gone (as if it stopped)."""
    shutil.copytree(source, target)
    for later in (target / "checkpoints").iterdir():
        if later.name.isdigit() and int(later.name) > step:
            shutil.rmtree(later)
    return target


def kill_all() -> None:
    """SIGKILL every process started here that is still running (a stopped one too)."""
    for proc in PROCESSES:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
