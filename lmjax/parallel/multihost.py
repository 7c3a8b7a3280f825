"""Several processes (hosts), one run: `jax.distributed`, per-host batches, one writer.

Start-up (`initialize_from_env`, called by `lmjax train` before jax touches a device), chosen by
environment variables:

    LMJAX_COORDINATOR=host:port  LMJAX_NUM_PROCESSES=N  LMJAX_PROCESS_ID=i
        explicit: `jax.distributed.initialize(host:port, N, i)` (any cluster, e.g. GPU hosts)
    LMJAX_DISTRIBUTED=auto
        `jax.distributed.initialize()` with no arguments: jax detects Cloud TPU slices, SLURM
        and Open MPI itself (scripts/tpu/ sets this on every worker)
    none of them
        one process; nothing is initialized (the default)

Anything else (ranks without a coordinator, both modes, another LMJAX_DISTRIBUTED value, an
address without a port) is a `ConfigError`: a half-configured host would otherwise train alone
as process 0 and write the shared run directory.

A lost process (killed, preempted, its host gone): `LMJAX_HEARTBEAT_TIMEOUT=S` (seconds, default
50). Every process beats into jax's coordination key-value store every S/10 s and watches the
others' beats (`Watchdog`); one silent for S s, or a coordinator unreachable for S s, makes each
survivor print one line (`lmjax train: error: heartbeat of process 1 of 2 = none for 5 s ...`) and
exit with status `EXIT_LOST` (75, EX_TEMPFAIL: run it again with --resume). A collective that
fails because a peer's connection closed (gloo's `Connection closed by peer`) ends the same way
at once, and any other error of the train loop (not lmjax's own) first waits for the watchdog's
verdict (`exit_if_peer_lost`). jax's own heartbeat timeout J is set to 4 S
(`JAX_HEARTBEAT_FACTOR`), so lmjax's line comes first: jax's would abort the process with a C++
stack trace. jax's agent beats every J/2 and its service acts once J has passed since a task's
last beat, between about J/2 and J after a death (benchmarks/jax_heartbeat_window.py); at
J = 2 S its earliest fell on lmjax's S, and it aborted a CI run 6.6 s after a kill at S = 6.
The exit skips jax's shutdown barrier, which with a dead peer waits and logs the failure again.
When process 0 itself dies (it hosts the coordination service), a survivor waiting in a
collective meets gloo's closed connection and stops with lmjax's line, unless jax's agent
aborts it first (SIGABRT, status 134): jaxlib has no hook before that abort (its
`missed_heartbeat_callback` cannot be given from Python: calling it throws bad_cast), so each
process's witness (`lmjax.parallel.witness`, a small process outside it) prints the line then,
naming process 0 and the step this one last started.
A hung process (alive, its heartbeats going, but never reaching the next collective: a stuck
data read, a deadlock): `LMJAX_STEP_TIMEOUT=T` (seconds, default 600; 0 turns it off). Each
process also publishes the last step it started (`at_step`, called as a step is dispatched);
one that started no step for T s stops with one line naming the processes behind it (`process
1 of 2 = last started step 2, while process 0 waits in step 3`) or itself, status
`EXIT_LOST`. The clock starts at a process's second step, so the first (which compiles) has no
bound; what runs between two steps (an evaluation, a checkpoint save) counts into T.
Tested with real processes in tests/test_multiprocess.py.

Data: every host computes the same random crop starts (a pure function of seed and step) but
reads only the rows its own devices hold (`host_batch`), then the global batch is assembled
from the per-device pieces; concatenated over hosts it is exactly the single-host batch.
Writing: only process 0 writes the run's config, metrics, samples and plots (`is_main`);
orbax checkpoint writes are collective (every process calls save; each writes its shards),
so the checkpoint directory must be one all hosts share (e.g. an NFS or gcsfuse mount).
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time

import jax
import numpy as np
from jax._src import distributed as jax_distributed  # the client orbax uses too; not public
from jax.experimental import multihost_utils

from lmjax.checks import require
from lmjax.errors import ConfigError, LMJaxError
from lmjax.parallel import witness

ENV_COORDINATOR = "LMJAX_COORDINATOR"
ENV_NUM_PROCESSES = "LMJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "LMJAX_PROCESS_ID"
ENV_AUTO = "LMJAX_DISTRIBUTED"
ENV_HEARTBEAT = "LMJAX_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_S = 50  # S when unset
JAX_HEARTBEAT_FACTOR = 4  # jax's own timeout J = 4 S: its earliest abort, J/2, is S after lmjax's
ENV_STEP = "LMJAX_STEP_TIMEOUT"
# Longer than a step, an evaluation or a checkpoint save of the models lmjax trains (an 8B
# model's save is a minute or two), far shorter than a hang left to the cluster's scheduler.
DEFAULT_STEP_S = 600
EXIT_LOST = 75  # sysexits' EX_TEMPFAIL: the run stopped whole; run it again with --resume
BEAT_KEY = "lmjax/heartbeat"
WATCHING: list = []  # the Watchdog initialize_from_env started in this process, if any


def distributed_args(env: dict[str, str] | None = None) -> dict | None:
    """The `jax.distributed.initialize` keyword arguments the environment asks for, or None.

    They include jax's heartbeat timeout, `JAX_HEARTBEAT_FACTOR` x S (S = `heartbeat_seconds`,
    set or its default; see the module docstring for why 4)."""
    env = os.environ if env is None else env
    kwargs = _cluster_args(env)
    if kwargs is not None:
        kwargs["heartbeat_timeout_seconds"] = JAX_HEARTBEAT_FACTOR * heartbeat_seconds(env)
    return kwargs


def heartbeat_seconds(env: dict[str, str] | None = None) -> int:
    """`LMJAX_HEARTBEAT_TIMEOUT`: seconds of silence after which a process is declared lost."""
    env = os.environ if env is None else env
    text = env.get(ENV_HEARTBEAT) or str(DEFAULT_HEARTBEAT_S)
    fix = f"export {ENV_HEARTBEAT}={DEFAULT_HEARTBEAT_S} (the default), or unset it"
    ok = text.isdigit() and int(text) >= 1
    require(ok, ENV_HEARTBEAT, text, "a whole number of seconds >= 1", fix)
    return int(text)


def step_seconds(env: dict[str, str] | None = None) -> int | None:
    """`LMJAX_STEP_TIMEOUT`: seconds without a new step after which a process stops (None: 0,
    no bound)."""
    env = os.environ if env is None else env
    text = env.get(ENV_STEP) or str(DEFAULT_STEP_S)
    fix = f"export {ENV_STEP}={DEFAULT_STEP_S} (the default) or {ENV_STEP}=0 (no bound)"
    require(text.isdigit(), ENV_STEP, text, "a whole number of seconds (0: no bound)", fix)
    return int(text) or None


def at_step(step: int) -> None:
    """Tell the `Watchdog` (if any) that this process starts `step` now (numbered as
    metrics.jsonl and the checkpoints number it: the step that ends at checkpoint `step`)."""
    if WATCHING:
        WATCHING[-1].at_step(step, time.monotonic())
    witness.at_step(step)


def _cluster_args(env) -> dict | None:
    """Who the processes are: coordinator and ranks, `{}` (jax detects them) or None (one)."""
    auto, address = env.get(ENV_AUTO), env.get(ENV_COORDINATOR)
    ranks = [name for name in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if env.get(name)]
    if auto:
        fix = f"export {ENV_AUTO}=auto, or unset it and set {ENV_COORDINATOR} and the ranks"
        require(auto.lower() == "auto", ENV_AUTO, auto, "auto (jax finds the hosts) or unset", fix)
        others = [ENV_COORDINATOR] * bool(address) + ranks
        fix = f"unset {ENV_AUTO} to name the coordinator yourself, or unset the others"
        require(not others, ENV_AUTO, auto, f"not both it and {', '.join(others)}", fix)
        return {}
    if not address:
        # A rank without a coordinator would silently train alone, as process 0.
        named = " and ".join(ranks)
        expected = f"host:port of process 0 (since {named} set)"
        fix = (
            f"export {ENV_COORDINATOR}=<process 0's host>:<port>, or unset {named} for one process"
        )
        require(not ranks, ENV_COORDINATOR, None, expected, fix)
        return None
    host, _, port = address.rpartition(":")
    fix = "give process 0's address and a free port"
    ok = bool(host) and port.isdigit()
    require(ok, ENV_COORDINATOR, address, "host:port (e.g. 10.0.0.2:1234)", fix)
    values = {}
    for name in (ENV_NUM_PROCESSES, ENV_PROCESS_ID):
        text = env.get(name, "")
        expected = f"a non-negative int (set with {ENV_COORDINATOR})"
        fix = f"export {ENV_NUM_PROCESSES}=<hosts> {ENV_PROCESS_ID}=<this host's rank>"
        require(text.isdigit(), name, text or None, expected, fix)
        values[name] = int(text)
    n, i = values[ENV_NUM_PROCESSES], values[ENV_PROCESS_ID]
    if not 0 <= i < n:
        raise ConfigError.describe(
            ENV_PROCESS_ID, i, f"in [0, {ENV_NUM_PROCESSES} = {n})", "number hosts 0..N-1"
        )
    return {"coordinator_address": address, "num_processes": n, "process_id": i}


def initialize_from_env(env: dict[str, str] | None = None) -> bool:
    """Call `jax.distributed.initialize` if the environment says so, and start the `Watchdog`
    of the other processes; True if it did."""
    kwargs = distributed_args(env)
    if kwargs is None:
        return False
    seconds, step_s = heartbeat_seconds(env), step_seconds(env)
    jax.distributed.initialize(**kwargs)
    client = jax_distributed.global_state.client
    if client is not None and jax.process_count() > 1:
        rank, count = jax.process_index(), jax.process_count()
        watchdog = Watchdog(client, rank, count, seconds, step_timeout_s=step_s)
        watchdog.start()
        WATCHING.append(watchdog)
        atexit.register(watchdog.stop)  # runs before jax's own shutdown (registered earlier)
        coordinator = jax_distributed.global_state.coordinator_address
        if coordinator:  # a line even where jax aborts this process (lmjax.parallel.witness)
            try:
                witness.start(coordinator, rank, aborted_message(rank, count))
            except OSError as err:  # no pipe or process to spare: train on, without the line
                print(f"lmjax train: warning: no witness process ({err})", file=sys.stderr)
    return True


def aborted_message(rank: int, count: int) -> str:
    """The line `lmjax.parallel.witness` prints when jax aborted this process after the
    coordinator went (with `witness.STEP_PLACE` for where this process was)."""
    value = _Raw(
        f"unreachable, and jax aborted this process ({rank} of {count}) {witness.STEP_PLACE}"
    )
    line = _lost_text(f"the coordinator (process 0 of {count})", value, "134 (jax's abort)")
    return f"lmjax train: error: {line}"


def barrier(name: str) -> None:
    """Wait until every process gets here (nothing to wait for with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def is_main() -> bool:
    """True on the process that writes logs, samples and plots (process 0)."""
    return jax.process_index() == 0


def batch_rows(sharding, shape: tuple[int, ...], devices) -> list[int]:
    """The rows of dim 1 (the batch dim of `[A, B, T]`) that `devices` hold, in order."""
    index_map = sharding.devices_indices_map(tuple(shape))
    rows = set()
    for device in devices:
        rows.update(range(*index_map[device][1].indices(shape[1])))
    return sorted(rows)


def host_batch(read_rows, shape: tuple[int, ...], sharding):
    """Global `[A, B, T]` arrays of which this process reads only its own rows.

    `read_rows(rows)` returns a pytree of `[A, len(rows), T]` arrays for the given batch rows
    (the same rows in every micro-batch); it is called once, with the rows this process's
    devices hold. Returns the same pytree of global `jax.Array`s laid out by `sharding`.
    """
    rows = batch_rows(sharding, shape, jax.local_devices())
    where = {row: i for i, row in enumerate(rows)}

    def assemble(local):
        local = np.asarray(local)

        def piece(index):
            picked = [where[r] for r in range(*index[1].indices(shape[1]))]
            return local[index[0]][:, picked][..., index[2]]

        return jax.make_array_from_callback(tuple(shape), sharding, piece)

    return jax.tree.map(assemble, read_rows(rows))


def place(tree, shardings):
    """`tree` (the same values on every process, e.g. a base model each one loaded) laid out by
    `shardings`, a tree of `NamedSharding`s of the same structure: each device's block is cut
    from a host copy, so this works across processes, where `jax.device_put` of a
    process-local array onto devices of other processes would not."""

    def one(leaf, sharding):
        host = np.asarray(jax.device_get(leaf))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def host_copy(tree):
    """`tree` as host (numpy) arrays, whole: gathered from every process when there are several
    (a collective: every process must call it), else fetched from its devices."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def silent_processes(last_heard: dict[int, float], now: float, timeout_s: float) -> list[int]:
    """The processes not heard from for more than `timeout_s` (times on one local clock)."""
    return sorted(p for p, heard in last_heard.items() if now - heard > timeout_s)


def lost_message(
    lost: list[int], count: int, timeout_s: float, coordinator: bool, note: str = ""
) -> str:
    """The one line a survivor prints; `coordinator`: the key-value store itself is gone;
    `note`: where the steps stood (`Watchdog.steps_note`)."""
    setting = f"{ENV_HEARTBEAT}={timeout_s:g}"
    if coordinator:
        what = f"the coordinator (process 0 of {count})"
        return _lost_text(what, f"no answer for {timeout_s:g} s ({setting}){note}")
    ranks = ", ".join(map(str, lost))
    what = f"heartbeat of process{'es' * (len(lost) > 1)} {ranks} of {count}"
    return _lost_text(what, f"none for {timeout_s:g} s ({setting}){note}")


def processes_behind(peers: dict[int, int], step: int) -> list[int]:
    """The processes whose last started step (`peers`) is before `step`, in rank order."""
    return sorted(p for p, s in peers.items() if s < step)


def stalled_message(rank: int, step: int, peers: dict[int, int], count: int, timeout_s: float):
    """The line of a process that started no step after `step` for `timeout_s`: the processes
    behind it (by the last step each started, `peers`) are named; else itself, if the others
    are ahead; else all of them."""
    setting = f"{ENV_STEP}={timeout_s:g}"
    behind = processes_behind(peers, step)
    if behind:
        last = min(peers[p] for p in behind)
        ranks = ", ".join(map(str, behind))
        what = f"process{'es' * (len(behind) > 1)} {ranks} of {count}"
        value = f"last started step {last}, while process {rank} waits in step {step}"
    elif any(s > step for s in peers.values()):
        what = f"this process ({rank} of {count})"
        value = f"last started step {step}, while the others are in step {max(peers.values())}"
    else:
        what, value = f"every process ({count})", f"in step {step}"
    return _lost_text(what, f"{value}, with no new step for {timeout_s:g} s ({setting})")


def _lost_text(what: str, value: str, status: str = str(EXIT_LOST)) -> str:
    expected = (
        "every process of the run alive (one was killed, preempted, crashed or hung; this "
        f"one stops too, with status {status})"
    )
    fix = (
        "run the same lmjax train command with --resume on every host: it continues from "
        "the newest complete checkpoint"
    )
    return str(LMJaxError.describe(what, _Raw(value), expected, fix))


def stop_lost(message: str) -> None:
    """Print `lmjax train: error: message` and end this process with `EXIT_LOST`, at once: a
    normal exit would wait in jax's shutdown barrier for the dead process."""
    sys.stdout.flush()
    print(f"lmjax train: error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_LOST)


def exit_if_peer_lost(err: BaseException) -> None:
    """After an error in a run of several processes: `stop_lost` if a peer is gone, else return
    (the caller re-raises `err`). A failed gloo collective (`Gloo all-reduce failed: ...
    Connection closed by peer`, also wrapped in a `CheckpointError` by a save) says so at once;
    another error that is not lmjax's waits for the `Watchdog`'s verdict (at most its timeout
    and two beats), which stops this process if a peer is silent."""
    if jax.process_count() == 1:
        return
    text = str(err).strip()
    # Also inside lmjax's own errors: a checkpoint save reports its failed gloo all-gather.
    if "Gloo" in text or "Connection closed by peer" in text:
        where = WATCHING[-1].steps_note() if WATCHING else ""
        stop_lost(_lost_text("a collective with the other processes", _gloo_failure(text) + where))
    if WATCHING and not isinstance(err, LMJaxError):  # lmjax's own errors happen on every host
        dog = WATCHING[-1]
        dog.done.wait(dog.timeout_s + 2 * dog.interval_s)  # its judge exits meanwhile if lost


def _gloo_failure(text: str) -> str:
    """`Gloo AllGather failed: [pair.cc:547] Connection closed by peer [h]:p` -> `failed (Gloo
    AllGather failed: Connection closed by peer)`: what failed and why, without the source line."""
    found = re.search(r"(Gloo [\w-]+ failed)[^\]]*\]\s*([^\[;'\n]*)", text)
    why = f"{found[1]}: {found[2].strip()}" if found else "Connection closed by peer"
    return f"failed ({why})"


class Watchdog:
    """Heartbeats between the processes of a run, through jax's coordination key-value store.

    A beating thread writes `BEAT_KEY/<rank>` ("<counter> <last step started>") every
    `timeout_s / 10` seconds and reads every process's key; a judging thread (apart, so that an
    RPC stuck on a dead coordinator cannot hide it) checks that each counter moved, and the
    store answered, within `timeout_s` on this process's clock, and (with `step_timeout_s`)
    that this process started a step within `step_timeout_s` of its last (from its second
    step on), else calls `on_lost(message)` (`stop_lost`). A process that wrote `exited`
    (`stop`, at a normal exit) is no longer watched.
    """

    def __init__(
        self, client, rank, count, timeout_s: float, on_lost=stop_lost, step_timeout_s=None
    ):
        self.client, self.rank, self.count = client, rank, count
        self.timeout_s, self.interval_s = timeout_s, max(timeout_s / 10, 0.05)
        self.on_lost, self.step_timeout_s = on_lost, step_timeout_s
        start = time.monotonic()
        self.last_heard = {p: start for p in range(count) if p != rank}
        self.last_answer, self.seen, self.peer_steps = start, {}, {}
        self.step, self.stepped_at = None, None  # this process's last step, and when (clock)
        self.done = threading.Event()

    def at_step(self, step: int, now: float) -> None:
        """This process starts `step` at `now`; the step clock starts at the second call."""
        self.stepped_at = None if self.step is None else now
        self.step = step

    def steps_note(self, ranks=None) -> str:
        """`; process 1 of 2 last started step 3, this one step 4`: where `ranks` (default: the
        peers behind this process, else every peer) stood, by the steps their heartbeats
        carried (`; this one step 4` when none was heard; "" before this process's first
        step)."""
        if self.step is None:
            return ""
        known = self.peer_steps
        if ranks is None:
            ranks = processes_behind(known, self.step) or list(known)
        ranks = sorted(p for p in ranks if p in known)
        peers = "; ".join(
            f"process {p} of {self.count} last started step {known[p]}" for p in ranks
        )
        return f"; {peers}, this one step {self.step}" if peers else f"; this one step {self.step}"

    def start(self) -> None:
        for target, name in ((self._beat, "beat"), (self._judge, "judge")):
            threading.Thread(target=target, name=f"lmjax-{name}", daemon=True).start()

    def stop(self) -> None:
        """Leave the watch: the others stop expecting this process's beats."""
        self.done.set()
        try:
            self.client.key_value_set(f"{BEAT_KEY}/{self.rank}", "exited", allow_overwrite=True)
        except Exception:  # noqa: BLE001  (the store may be gone already: nothing to tell)
            pass

    def _beat(self) -> None:
        beat = 0
        while not self.done.is_set():
            beat += 1
            try:
                value = f"{beat} {'-' if self.step is None else self.step}"
                self.client.key_value_set(f"{BEAT_KEY}/{self.rank}", value, allow_overwrite=True)
                values = self.client.key_value_dir_get(BEAT_KEY)
            except Exception:  # noqa: BLE001  (an unreachable store: the judge times it out)
                values = None
            if values is not None:
                self.heard(dict(values), time.monotonic())
            self.done.wait(self.interval_s)

    def heard(self, values: dict[str, str], now: float) -> None:
        """Record one answer of the store: `{BEAT_KEY/<rank>: "<counter> <step or ->" or
        "exited"}` at `now`."""
        self.last_answer = now
        for key, value in values.items():
            rank = int(key.rsplit("/", 1)[1])
            if value == "exited":
                self.last_heard.pop(rank, None)
                self.peer_steps.pop(rank, None)
            elif rank in self.last_heard and self.seen.get(rank) != value:
                self.seen[rank], self.last_heard[rank] = value, now
                step = value.partition(" ")[2]
                if step.isdigit():
                    self.peer_steps[rank] = int(step)

    def verdict(self, now: float) -> str | None:
        """The line to stop with at `now`, or None while every watched process is heard."""
        if now - self.last_answer > self.timeout_s:
            return lost_message([0], self.count, self.timeout_s, True, self.steps_note([0]))
        lost = silent_processes(self.last_heard, now, self.timeout_s)
        if lost:
            return lost_message(lost, self.count, self.timeout_s, False, self.steps_note(lost))
        limit, since = self.step_timeout_s, self.stepped_at
        if limit and since is not None and now - since > limit:
            return stalled_message(self.rank, self.step, self.peer_steps, self.count, limit)
        return None

    def _judge(self) -> None:
        while not self.done.wait(self.interval_s):
            message = self.verdict(time.monotonic())
            if message and not self.done.is_set():
                self.on_lost(message)
                return


class _Raw(str):
    """A value shown as is in an error message (not as a quoted repr)."""

    def __repr__(self) -> str:
        return str(self)
