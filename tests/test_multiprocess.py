"""Several real processes, one run: `lmjax train` under `jax.distributed` on loopback.

JAX's CPU backend runs cross-process collectives over gloo, so N local processes started with
LMJAX_COORDINATOR=127.0.0.1:PORT / LMJAX_NUM_PROCESSES / LMJAX_PROCESS_ID (and
`--xla_force_host_platform_device_count` devices each) are a real multi-controller cluster:
a coordination service, collectives between processes, orbax writing one checkpoint from all.

The runs (one corpus prepared once; each a fresh `lmjax train` subprocess):

    1x4     one process, 4 devices, data=2,fsdp=2, 4 steps          (the baseline of 2x2)
    2x2     two processes x 2 devices, the same global mesh, 4 steps
    resume  2x2's checkpoint 2 resumed by two new processes, then process 1 SIGKILLed
    1x8     2x2's checkpoint 2 resumed by one process on 8 devices, data=2,fsdp=4
    2x4     the same resumed by two processes x 4 devices, data=2,fsdp=4
    ft-1x4  `lmjax finetune` (QLoRA, all linear layers) of 1x4's model, data=2,fsdp=2
    ft-2x2  the same over two processes x 2 devices: the NF4 base sharded across them

Every process runs WORKER (benchmarks/_multiprocess.py, shared with the fault benchmark):
`lmjax train` with the batch rows it read (`train_batch`'s `rows`) and every file it wrote (a
`sys.addaudithook` on open/rename/mkdir) recorded.

Tolerance (rtol 1e-6 on losses and gradient norms, atol 1e-6 on parameters, float32): the
processes run the same partitioned program, but a reduction over devices in two processes runs
through gloo's all-reduce while one process sums its devices in XLA's in-process collective, in
another order: the losses differ in the last bit (seen: 3.6162589 vs 3.6162586). A sum of P
device partials in another order moves it by at most (P - 1) u = 1.8e-7 of the (positive) loss
for P = 4, u = 2^-24. Not a tolerance that depends on the CPU (issue 36): both runs are on one
host, so the same vector width, and the vector width orders sums across elements, not across the
P partials that alone are ordered differently. Resuming on the same processes and mesh repeats
every operation in order, so it is checked bit for bit.

Cost: about 90 s on 2 cores (measured 84-87 s with other work on the machine: 4 two-process
and 2 one-process starts, each importing jax and compiling a 1-layer model), plus the two
fine-tunes started together (one two-process and one one-process start); every process
started here is killed at the end, also on failure.
"""

from __future__ import annotations

import json
import os
import signal
import time

import jax
import numpy as np
import pytest
from _benchmarks import load_benchmark

from lmjax import cli, testing
from lmjax.data import prepared as D
from lmjax.errors import ConfigError
from lmjax.parallel import multihost
from lmjax.train.checkpoint import CheckpointError, Checkpoints
from lmjax.train.runs import load_run

P = load_benchmark("_multiprocess")  # the processes' launcher, shared with the benchmark
CONFIG, Run, resumed_copy = P.CONFIG, P.Run, P.resumed_copy
STEPS, BATCH, HEARTBEAT_S, STEP_S = 4, 8, 6, 8
# For the runs whose samples and plot no test reads: no sampler to compile, no matplotlib (the
# 2x2 run and the two-process fine-tune keep both, for the tests of what process 0 writes).
QUIET = ["logging.sample_tokens=0", "logging.plot=false"]


@pytest.fixture(scope="module", autouse=True)
def _kill_every_process():
    yield
    P.kill_all()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The corpus, prepared once (every process then reads the same data directory)."""
    root = tmp_path_factory.mktemp("multiprocess")
    text = "To be, or not to be, that is the question: whether tis nobler in the mind\n"
    (root / "corpus.txt").write_text(text * 60)
    D.prepare(str(root / "corpus.txt"), root / "data", tokenizer="char", progress=False)
    config = CONFIG.format(corpus=root / "corpus.txt", data=root / "data", steps=STEPS, batch=BATCH)
    (root / "c.yaml").write_text(config)
    return root


@pytest.fixture(scope="module")
def straight(corpus):
    """The 1x4 baseline and the 2x2 run, started together (their waits on each other overlap)."""
    config = str(corpus / "c.yaml")
    baseline = [config, *QUIET, "checkpoint.every=4"]  # compared at step 4, resumed by nothing
    runs = {"1x4": Run(corpus, "1x4", 1, 4, baseline), "2x2": Run(corpus, "2x2", 2, 2, [config])}
    return {name: run.finish() for name, run in runs.items()}


@pytest.fixture(scope="module")
def other_mesh(corpus, straight):
    """2x2's checkpoint 2 resumed on data=2,fsdp=4: by one process (8 devices) and by two (4)."""
    args = [str(corpus / "c.yaml"), "--resume", "parallel.mesh=data=2,fsdp=4", *QUIET,
            "checkpoint.every=2"]  # fmt: skip
    for name in ("1x8", "2x4"):
        resumed_copy(straight["2x2"].dir, corpus / name, 2)
    runs = {"1x8": Run(corpus, "1x8", 1, 8, args), "2x4": Run(corpus, "2x4", 2, 4, args)}
    return {name: run.finish() for name, run in runs.items()}


def assert_same_training(got: Run, want: Run, steps, exact: bool = False):
    """Losses, gradient norms and parameters at `steps[-1]` equal (see the module docstring)."""
    mine, theirs = got.metrics(), want.metrics()
    for step in steps:
        for key in ("loss", "grad_norm"):
            a, b = mine[step][key], theirs[step][key]
            assert a == b if exact else np.isclose(a, b, rtol=1e-6, atol=0), (step, key, a, b)
    mine, theirs = got.params(steps[-1]), want.params(steps[-1])
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
        if exact:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_two_processes_train_as_one_over_the_same_mesh(straight):
    assert_same_training(straight["2x2"], straight["1x4"], range(1, STEPS + 1))


def test_two_processes_of_four_devices_resume_as_one_process_of_eight(other_mesh):
    """The 2x2 checkpoint restores on another mesh (data=2,fsdp=4), in one process and in two,
    and they go on training alike."""
    assert_same_training(other_mesh["2x4"], other_mesh["1x8"], [3, 4])
    assert other_mesh["2x4"].metrics()[4]["lr"] == other_mesh["1x8"].metrics()[4]["lr"]


@pytest.mark.parametrize(("name", "start"), [("2x2", 0), ("2x4", 2)])
def test_each_process_reads_only_its_own_rows(straight, other_mesh, name, start):
    """The batch is split over data x fsdp (all devices, in process order): process i holds
    rows [i B/2, (i+1) B/2) of each step's batch and reads nothing else."""
    run = {**straight, **other_mesh}[name]
    half = BATCH // 2
    for i in range(2):
        rows = run.record(i)["rows"]
        assert [step for step, _ in rows] == list(range(start, STEPS))
        assert all(r == list(range(i * half, (i + 1) * half)) for _, r in rows), rows
    # The one-process baseline reads every row.
    baseline = straight["1x4"].record(0)["rows"]
    assert all(r == list(range(BATCH)) for _, r in baseline), baseline


def test_only_process_zero_writes_config_metrics_samples_and_plots(straight):
    run = straight["2x2"]
    written = [set(run.record(i)["writes"]) for i in range(2)]
    outside = [{w for w in ws if not w.startswith("checkpoints")} for ws in written]
    assert outside[1] == set(), outside[1]
    tops = {w.split(os.sep)[0] for w in outside[0]}
    assert {"config.yaml", "metrics.jsonl", "samples.txt", "loss.png", "tokenizer"} <= tops, tops
    assert (run.dir / "samples.txt").read_text().count("===== step") == 1
    # The checkpoint is written by both: each process writes files of its own under it.
    assert all(any(w.startswith("checkpoints") for w in ws) for ws in written), written
    steps = Checkpoints(run.dir / "checkpoints", create=False).steps()
    assert steps == list(range(1, STEPS + 1))


def test_the_checkpoint_restores_in_one_process_for_eval_and_generate(straight, capsys):
    run = straight["2x2"]
    assert cli.main(["eval", str(run.dir)]) == 0
    out = capsys.readouterr().out
    val = next(json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()
               if "val_loss" in x)  # fmt: skip
    assert f"step {STEPS}: validation loss {val['val_loss']:.4f}" in out, out
    args = ["generate", "--run", str(run.dir), "--prompt", "To", "--max-new-tokens", "3"]
    assert cli.main([*args, "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("To")


@pytest.fixture(scope="module")
def killed(corpus, straight):
    """2x2's checkpoint 2 resumed by two new processes with no end in sight; process 1 is
    SIGKILLed once checkpoint 5 is complete; process 0 must stop by itself."""
    resumed_copy(straight["2x2"].dir, corpus / "killed", 2)
    args = [str(corpus / "c.yaml"), "--resume", "train.steps=100000", *QUIET]
    run = Run(corpus, "killed", 2, 2, args, env={"LMJAX_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S)})
    run.wait_for_checkpoint(5)
    run.procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    code = run.procs[0].wait(timeout=4 * HEARTBEAT_S + 30)
    return run, code, time.monotonic() - killed_at


def test_resume_in_two_new_processes_continues_exactly(straight, killed):
    run, _, _ = killed
    assert_same_training(run, straight["2x2"], [3, 4], exact=True)


@pytest.fixture(scope="module")
def hung(corpus, straight):
    """2x2's checkpoint 2 resumed by two new processes; process 1 hangs reading the batch of
    step 5 (`train_batch`'s 0-based step 4, after checkpoint 4), alive and heart-beating. Both
    must stop by themselves within the step bound (evaluation moved out of the way: its first
    compile would count into the bound, docs/scale.md)."""
    resumed_copy(straight["2x2"].dir, corpus / "hung", 2)
    args = [str(corpus / "c.yaml"), "--resume", "train.steps=100000", "train.eval_every=1000",
            *QUIET]  # fmt: skip
    env = {"LMJAX_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S), "LMJAX_STEP_TIMEOUT": str(STEP_S),
           "HANG_AT": "1:4"}  # fmt: skip
    run = Run(corpus, "hung", 2, 2, args, env=env)
    run.wait_for_checkpoint(4)
    saved = time.monotonic()
    codes = run.wait(limit_s=STEP_S + HEARTBEAT_S + 60)
    return run, codes, time.monotonic() - saved


def test_a_hung_process_stops_every_process_naming_it_and_its_step(straight, hung):
    """Both processes exit EXIT_LOST with one line: process 1 (its own step clock) names
    itself and step 4, the last it started (steps numbered as logged); process 0 names process 1
    and that step, whichever
    way it noticed first (process 1's exit breaking the collective, its heartbeats stopping, or
    its own step clock). The checkpoints before the hang are the uninterrupted run's, bit for
    bit, and the newest loads."""
    run, codes, waited_s = hung
    assert codes == [multihost.EXIT_LOST] * 2, [run.stderr(i)[-2000:] for i in range(2)]
    assert waited_s < STEP_S + HEARTBEAT_S + 30, waited_s
    for i, named in ((1, ("this process (1 of 2) = last started step 4",)),
                     (0, ("process 1 of 2", "started step 4"))):  # fmt: skip
        err = run.stderr(i)
        lines = [line for line in err.splitlines() if "lmjax" in line and "error" in line]
        assert len(lines) == 1 and lines[0] == err.strip().splitlines()[-1], err[-3000:]
        assert all(w in lines[0] for w in named) and "--resume" in lines[0], lines[0]
        assert "Traceback" not in err and "Check failure" not in err
    assert Checkpoints(run.dir / "checkpoints", create=False).latest_step() == 4
    assert_same_training(run, straight["2x2"], [3, 4], exact=True)


class FakeClient:
    def key_value_set(self, key, value, allow_overwrite=False):
        pass


def test_the_watchdog_names_a_silent_process_or_a_silent_coordinator():
    """Its verdicts on a fake clock: heard beats reset a process's silence, `exited` drops it
    from the watch, and a store that stops answering is the coordinator's loss."""
    dog = multihost.Watchdog(FakeClient(), rank=0, count=3, timeout_s=5)
    t0 = dog.last_answer
    dog.heard({"lmjax/heartbeat/1": "7", "lmjax/heartbeat/2": "3"}, t0 + 4)
    assert dog.verdict(t0 + 8) is None
    dog.heard({"lmjax/heartbeat/1": "8", "lmjax/heartbeat/2": "3"}, t0 + 8)  # 2 did not beat
    assert dog.verdict(t0 + 8.5) is None
    message = dog.verdict(t0 + 9.5)
    assert message.startswith("heartbeat of process 2 of 3 = none for 5 s"), message
    assert "LMJAX_HEARTBEAT_TIMEOUT=5" in message and "--resume" in message
    dog.heard({"lmjax/heartbeat/1": "9", "lmjax/heartbeat/2": "exited"}, t0 + 9.5)
    assert dog.verdict(t0 + 10) is None  # 2 finished and left
    dog.at_step(4, t0 + 10)
    lost = dog.verdict(t0 + 15)  # the store stopped answering: the coordinator is gone
    assert lost.startswith("the coordinator (process 0 of 3) = no answer for 5 s"), lost
    assert lost.partition(";")[2].startswith(" this one step 4;"), lost  # no step heard from 0


def test_the_watchdog_names_who_stopped_starting_steps():
    """The step clock on a fake clock: none before the second step (the first compiles), then
    a process that started no step for `step_timeout_s` names whoever is behind by the steps
    the heartbeats carry: a peer, itself, or every process."""
    dog = multihost.Watchdog(FakeClient(), rank=0, count=3, timeout_s=50, step_timeout_s=5)
    t0 = dog.last_answer
    dog.at_step(2, t0)  # the first step of this process (a resume from 2): no bound
    assert dog.verdict(t0 + 40) is None and dog.steps_note() == "; this one step 2"  # none heard
    dog.at_step(3, t0 + 40)
    dog.heard({"lmjax/heartbeat/1": "9 3", "lmjax/heartbeat/2": "4 2"}, t0 + 44)
    assert dog.verdict(t0 + 44.9) is None
    message = dog.verdict(t0 + 45.1)
    assert message.startswith(
        "process 2 of 3 = last started step 2, while process 0 waits in "
        "step 3, with no new step for 5 s (LMJAX_STEP_TIMEOUT=5)"
    ), message
    assert "--resume" in message
    assert dog.steps_note() == "; process 2 of 3 last started step 2, this one step 3"
    dog.heard({"lmjax/heartbeat/1": "10 4", "lmjax/heartbeat/2": "5 4"}, t0 + 45.5)
    assert dog.verdict(t0 + 46).startswith(
        "this process (0 of 3) = last started step 3, while the others are in step 4"
    ), dog.verdict(t0 + 46)
    dog.at_step(4, t0 + 47)
    assert dog.verdict(t0 + 51.9) is None
    assert dog.steps_note([2]) == "; process 2 of 3 last started step 4, this one step 4"
    assert dog.verdict(t0 + 52.1).startswith("every process (3) = in step 4")
    off = multihost.Watchdog(FakeClient(), rank=0, count=2, timeout_s=50, step_timeout_s=None)
    off.at_step(1, t0), off.at_step(2, t0)
    off.heard({"lmjax/heartbeat/1": "1 2"}, t0 + 40)
    assert off.verdict(t0 + 45) is None  # LMJAX_STEP_TIMEOUT=0: no step bound


def test_jax_aborts_a_survivor_no_sooner_than_half_its_heartbeat_timeout():
    """What `JAX_HEARTBEAT_FACTOR` rests on, checked on this jax: after a peer's death, jax's own
    service aborts a survivor no sooner than about J/2 (its agent beats every J/2 and the service
    waits J from the last beat), so with J = 4 S lmjax's verdict at S (+ S/10 between beats)
    comes first. Plain jax, J = 4 s (S = 1), one kill: any phase of the beat gives >= J/2; the
    bound is 0.4 J to allow for the kill's own timing, still past S + S/10 + a poll."""
    window = load_benchmark("jax_heartbeat_window")
    kill = window.one_kill(timeout_s=4, delay_s=0.0)
    assert kill["status"] == -signal.SIGABRT, kill  # jax's LOG(FATAL), not an exit of its own
    assert kill["seconds"] >= 0.4 * 4, kill


def test_the_heartbeat_timeout_is_a_setting():
    env = {"LMJAX_COORDINATOR": "127.0.0.1:1", "LMJAX_NUM_PROCESSES": "2", "LMJAX_PROCESS_ID": "1"}
    # jax's timeout is 4 S, set or default: its earliest abort after a death (T/2, measured by
    # benchmarks/jax_heartbeat_window.py) then comes S after lmjax's verdict, never with it.
    assert multihost.distributed_args(env)["heartbeat_timeout_seconds"] == 200
    assert multihost.heartbeat_seconds(env) == multihost.DEFAULT_HEARTBEAT_S == 50
    env["LMJAX_HEARTBEAT_TIMEOUT"] = "7"
    assert multihost.distributed_args(env)["heartbeat_timeout_seconds"] == 28
    auto = {"LMJAX_DISTRIBUTED": "auto", "LMJAX_HEARTBEAT_TIMEOUT": "7"}  # jax finds the hosts
    assert multihost.distributed_args(auto) == {"heartbeat_timeout_seconds": 28}
    assert multihost.distributed_args({}) is None  # one process: nothing to initialize
    for bad in ("0", "-1", "2.5", "soon"):
        with pytest.raises(ConfigError, match="LMJAX_HEARTBEAT_TIMEOUT"):
            multihost.heartbeat_seconds({"LMJAX_HEARTBEAT_TIMEOUT": bad})
    assert multihost.step_seconds({}) == multihost.DEFAULT_STEP_S == 600
    assert multihost.step_seconds({"LMJAX_STEP_TIMEOUT": "30"}) == 30
    assert multihost.step_seconds({"LMJAX_STEP_TIMEOUT": "0"}) is None  # no bound
    for bad in ("-1", "2.5", "soon"):
        with pytest.raises(ConfigError, match="LMJAX_STEP_TIMEOUT"):
            multihost.step_seconds({"LMJAX_STEP_TIMEOUT": bad})


def test_a_failed_collective_stops_the_run_even_inside_an_lmjax_error(monkeypatch):
    """A checkpoint save whose gloo all-gather failed is reported by lmjax as a CheckpointError
    ('expected a writable directory'): the killed-process test met it, and the survivor then
    exited through jax's shutdown barrier, which aborted it (status 134)."""
    stopped = []
    monkeypatch.setattr(multihost, "stop_lost", stopped.append)
    monkeypatch.setattr(multihost.jax, "process_count", lambda: 2)
    gloo = "UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error [127.0.0.1]:1234"
    multihost.exit_if_peer_lost(CheckpointError(f"saving checkpoint step 6 = 'failed ({gloo})'"))
    assert len(stopped) == 1, stopped
    assert "failed (Gloo AllGather failed: Read error)" in stopped[0], stopped
    assert "--resume" in stopped[0]
    multihost.exit_if_peer_lost(ValueError("shapes (2,) and (3,) differ"))  # no watchdog here
    assert len(stopped) == 1


def test_a_killed_process_stops_the_others_with_one_line(killed):
    run, code, waited_s = killed
    ours = [x for x in run.stderr(0).splitlines() if not x.startswith(("[Gloo]", "W", "E", " "))]
    assert code == multihost.EXIT_LOST, "\n".join(ours)[-5000:]
    assert waited_s < 3 * HEARTBEAT_S + 10, waited_s
    err = run.stderr(0)
    lines = [line for line in err.splitlines() if "lmjax" in line and "error" in line]
    assert len(lines) == 1 and lines[0] == err.strip().splitlines()[-1], err[-3000:]
    assert lines[0].startswith("lmjax train: error: ")
    # Either way of noticing: gloo's closed connection in a collective (at once), or the
    # watchdog's missing heartbeats (after HEARTBEAT_S), whichever the survivor meets first.
    # jaxlib 0.10's gloo names the collective ("failed (Gloo AllGather failed: Connection closed
    # by peer)"); 0.12's error has the reason only ("failed (Connection closed by peer)").
    collective = "a collective with the other processes = failed ("
    noticed = ("heartbeat of process 1 of 2 = none", collective + "Gloo", collective + "Connection")
    assert any(w in lines[0] for w in noticed) and "--resume" in lines[0], lines[0]
    assert "Traceback" not in err and "Check failure" not in err


def test_a_killed_coordinator_stops_the_other_with_one_line(corpus, straight):
    """Process 0 hosts jax's coordination service. SIGKILLed, it leaves process 1 to end with
    lmjax's line naming process 0 and a step, whichever comes first: lmjax's handling of the
    failed collective (status 75) or jax's agent aborting the process (SIGABRT; the line is
    then its witness's, lmjax.parallel.witness). Which one wins is a race (both happened here)."""
    resumed_copy(straight["2x2"].dir, corpus / "coordinator", 2)
    args = [str(corpus / "c.yaml"), "--resume", "train.steps=100000", *QUIET]
    env = {"LMJAX_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S)}
    run = Run(corpus, "coordinator", 2, 2, args, env=env)
    run.wait_for_checkpoint(3)
    run.procs[0].send_signal(signal.SIGKILL)
    code = run.procs[1].wait(timeout=4 * HEARTBEAT_S + 30)
    assert code in (multihost.EXIT_LOST, -signal.SIGABRT), run.stderr(1)[-3000:]
    last = run.last_line(1, wait_s=10)
    assert last.startswith("lmjax train: error: ") and "--resume" in last, run.stderr(1)[-3000:]
    assert "process 0 of 2" in last and " step " in last, last


def test_the_last_complete_checkpoint_of_a_killed_run_loads(killed):
    run, _, _ = killed
    latest = Checkpoints(run.dir / "checkpoints", create=False).latest_step()
    assert latest >= 5
    loaded = load_run(run.dir)
    assert loaded.step == latest
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(loaded.params))


@pytest.fixture(scope="module")
def no_mesh(corpus, straight):
    """The 2x2 run with `parallel.mesh` null (issue 22: it failed at its first checkpoint with
    "Cannot serialize host local jax.Array": each process trained its own one-device copy)."""
    args = [str(corpus / "c.yaml"), "parallel.mesh=null", *QUIET]
    return Run(corpus, "nomesh", 2, 2, args).finish()


def test_two_processes_without_a_mesh_train_data_parallel_over_every_device(straight, no_mesh):
    """With no mesh they train as one run over data=4 (every device of both processes): each
    process reads its half of the rows, the collective checkpoints are all written, and the
    losses and parameters are those of the one-process run (data=2,fsdp=2: the same mean)."""
    assert_same_training(no_mesh, straight["1x4"], range(1, STEPS + 1))
    half = BATCH // 2
    for i in range(2):
        rows = no_mesh.record(i)["rows"]
        assert all(r == list(range(i * half, (i + 1) * half)) for _, r in rows), rows
    steps = Checkpoints(no_mesh.dir / "checkpoints", create=False).steps()
    assert steps == list(range(1, STEPS + 1))
    assert "mesh: null" in (no_mesh.dir / "config.yaml").read_text()  # a resume picks again


def test_the_mesh_of_a_run_without_one(monkeypatch):
    """One process: none (one device, as always); several: data over every device, whose
    batch must split evenly (one line naming the default); a given mesh is checked, in full."""
    from lmjax.parallel import mesh

    n = jax.device_count()
    assert mesh.run_mesh_shape(None, 3) is None
    assert mesh.run_mesh_shape({"data": n}, 3) == {"data": n, "fsdp": 1, "model": 1}
    with pytest.raises(ConfigError, match="product equals"):
        mesh.run_mesh_shape({"data": n + 1}, 8)
    monkeypatch.setattr(mesh.jax, "process_count", lambda: 2)
    monkeypatch.setattr(mesh.jax, "device_count", lambda: 4)  # 2 processes x 2 devices
    assert mesh.run_mesh_shape(None, 8) == {"data": 4, "fsdp": 1, "model": 1}
    with pytest.raises(ConfigError, match=r"parallel.mesh null over 2 processes.*multiple of"):
        mesh.run_mesh_shape(None, 6)


FINETUNE = """
finetune: {{base: {base}, qlora: true}}
lora: {{r: 4, alpha: 8, targets: [all-linear], dropout: 0.0}}
data: {{corpus: {corpus}, tokenizer: char}}
schedule: {{warmup_steps: 1}}
train: {{steps: 2, batch_size: {batch}, seq_len: 8, eval_every: 2, eval_batches: 1}}
checkpoint: {{every: 1}}
logging: {{every: 1, progress: false, sample_tokens: 2, sample_prompt: T, peak_flops: 1.0e+12}}
parallel: {{mesh: "data=2,fsdp=2"}}
"""


@pytest.fixture(scope="module")
def finetuned(corpus, straight):
    """QLoRA of the 1x4 run's model, in one process of 4 devices and in two of 2 (the same
    global mesh). The corpus is encoded with the base's tokenizer and cached here first, so
    the processes read one cache entry instead of racing to write it."""
    from lmjax import finetune

    text = FINETUNE.format(base=straight["1x4"].dir, corpus=corpus / "corpus.txt", batch=BATCH)
    (corpus / "ft.yaml").write_text(text)
    # (this process has one device: the data section alone decides the cache entry)
    cfg, _, base_run = finetune.load_config(corpus / "ft.yaml", ["parallel.mesh=null"])
    finetune.prepare_base_data(cfg, base_run)
    args = [str(corpus / "ft.yaml")]
    runs = {
        "ft-1x4": Run(corpus, "ft-1x4", 1, 4, [*args, *QUIET], verb="finetune"),
        "ft-2x2": Run(corpus, "ft-2x2", 2, 2, args, verb="finetune"),
    }
    return {name: run.finish() for name, run in runs.items()}


def test_two_processes_fine_tune_as_one_over_the_same_mesh(finetuned):
    """QLoRA over two processes: the losses, gradient norms and merged parameters of one
    process on the same mesh (module docstring's tolerance), each process reading its half of
    the rows; only process 0 writes the adapters, the merged model and the logs."""
    got, want = finetuned["ft-2x2"], finetuned["ft-1x4"]
    assert_same_training(got, want, [1, 2])
    half = BATCH // 2
    for i in range(2):
        rows = got.record(i)["rows"]
        assert rows and all(r == list(range(i * half, (i + 1) * half)) for _, r in rows), rows
    outside = {w for w in got.record(1)["writes"] if not w.startswith("checkpoints")}
    assert outside == set(), outside
    written = {w.split(os.sep)[0] for w in got.record(0)["writes"]}
    assert {"adapters.safetensors", "merged", "finetune.yaml", "samples.txt"} <= written, written
    # merged/ (merged on the mesh) is the checkpoint's model (merged here, on one device): the
    # same dequantize (3 roundings) + s B A (a dot of r = 4 terms, then the scale) + add per
    # element, evaluated in two programs, so within f32_rtol of that chain of max |W'|.
    merged = load_run(got.dir / "merged").params
    chain = 3 + 4 + 2
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(got.params(2)), strict=True):
        b = np.asarray(b)
        atol = testing.f32_rtol(chain) * float(np.abs(b).max())
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol)
