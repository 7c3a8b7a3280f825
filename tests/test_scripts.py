"""scripts/tpu and scripts/gpu cannot run here (no gcloud project, no GPU): their dry runs
(DRY_RUN=1 prints each command, shell-quoted, instead of running it) are checked command by
command, every script passes `bash -n`, and shellcheck when it is installed."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
TPU = ROOT / "scripts" / "tpu" / "tpu.sh"
GPU = ROOT / "scripts" / "gpu" / "train.sh"
OURS = [
    *sorted(p for d in ("tpu", "gpu", "lib") for p in (ROOT / "scripts" / d).glob("*.sh")),
    ROOT / "scripts" / "newest_python.sh",
    ROOT / ".ci" / "run",
]
NEWEST_PYTHON = ROOT / "scripts" / "newest_python.sh"


def dry(script: Path, *args: str, **env: str) -> list[list[str]]:
    """The commands a dry run prints, each split back into its words."""
    done = subprocess.run(
        ["bash", str(script), *args],
        env={**os.environ, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines and all(line.startswith("+ ") for line in lines), done.stdout
    return [shlex.split(line[2:]) for line in lines]


def test_every_script_parses():
    for script in [*OURS, ROOT / "scripts" / "gpu_check.sh"]:
        subprocess.run(["bash", "-n", str(script)], check=True)


def _shellcheck() -> str | None:
    local = Path(sys.executable).parent / "shellcheck"
    return str(local) if local.exists() else shutil.which("shellcheck")


@pytest.mark.skipif(_shellcheck() is None, reason="shellcheck not installed (test extra)")
def test_shellcheck():
    subprocess.run([_shellcheck(), *map(str, OURS)], check=True)
    # gpu_check.sh (another issue's) has one info-level note (ls in a summary line).
    subprocess.run([_shellcheck(), "-S", "warning", str(ROOT / "scripts/gpu_check.sh")], check=True)


def _fake_pythons(tmp_path: Path, on_path: dict[str, int], under_pyenv: dict[str, int]) -> dict:
    """A PATH with `pythonX.Y` commands exiting with the given codes (a pyenv shim of a version
    not selected exits non-zero) and a pyenv whose root holds the given full versions."""
    bin_dir, root = tmp_path / "bin", tmp_path / "pyenv"
    bin_dir.mkdir()
    for name, code in on_path.items():
        (bin_dir / name).write_text(f"#!/bin/sh\nexit {code}\n")
    for version, code in under_pyenv.items():
        exe = root / "versions" / version / "bin" / f"python{version.rsplit('.', 1)[0]}"
        exe.parent.mkdir(parents=True)
        exe.write_text(f"#!/bin/sh\nexit {code}\n")
    versions = "\\n".join(under_pyenv)
    (bin_dir / "pyenv").write_text(
        f'#!/bin/sh\ncase "$1" in root) echo {root};; versions) printf "{versions}\\n";; esac\n'
    )
    for exe in [*bin_dir.iterdir(), *root.rglob("python*")]:
        exe.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def test_newest_python_takes_the_newest_that_runs(tmp_path):
    """`make test-next`'s interpreter: 3.13 before 3.12; a shim that refuses (pyenv's, for a
    version not selected) is passed over for pyenv's own copy; the newest patch release."""
    env = _fake_pythons(
        tmp_path, {"python3.13": 127}, {"3.12.1": 0, "3.12.10": 0, "3.13.0": 0, "3.13.1": 1}
    )

    def newest(*versions):
        cmd = ["bash", str(NEWEST_PYTHON), *versions]
        return subprocess.run(cmd, env=env, capture_output=True, text=True)

    assert newest().stdout.strip() == str(tmp_path / "pyenv/versions/3.13.0/bin/python3.13")
    assert newest("3.12").stdout.strip() == str(tmp_path / "pyenv/versions/3.12.10/bin/python3.12")
    missing = newest("3.14", "3.15")
    assert missing.returncode == 1 and missing.stdout == ""
    assert "no Python 3.14 3.15 found" in missing.stderr


def test_newest_python_prefers_a_command_on_path(tmp_path):
    env = _fake_pythons(tmp_path, {"python3.13": 0}, {"3.13.0": 0})
    done = subprocess.run(["bash", str(NEWEST_PYTHON)], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == str(tmp_path / "bin" / "python3.13")


def test_tpu_all_creates_installs_launches_streams_fetches_and_deletes():
    env = {"TPU_NAME": "t1", "ZONE": "us-central2-b", "ACCELERATOR": "v4-16", "RUN_NAME": "r1"}
    cmds = dry(TPU, "all", "configs/tpu-gpt2-124m.yaml", "train.steps=10", **env)
    gcloud = [c for c in cmds if c[0] == "gcloud"]
    verbs = [c[4] for c in gcloud]
    assert verbs == ["create", "scp", "ssh", "ssh", "ssh", "scp", "scp", "delete"], verbs
    assert all(c[:4] == ["gcloud", "compute", "tpus", "tpu-vm"] for c in gcloud)
    assert all("--zone=us-central2-b" in c and c[5] == "t1" or c[4] == "scp" for c in gcloud)

    create = gcloud[0]
    assert create[5] == "t1" and "--accelerator-type=v4-16" in create
    assert any(a.startswith("--version=") for a in create) and "--spot" not in create

    archive = next(c for c in cmds if c[0] == "git")
    assert archive[-1] == "HEAD" and "archive" in archive
    out = next(a for a in archive if a.startswith("--output=")).split("=", 1)[1]
    copy = gcloud[1]
    assert copy[5:7] == [out, "t1:lmjax.tar.gz"] and "--worker=all" in copy

    install, launch, logs = gcloud[2], gcloud[3], gcloud[4]
    assert "--worker=all" in install and "--worker=all" in launch and "--worker=0" in logs
    setup = _command(install)
    assert "tar -xzf lmjax.tar.gz" in setup and "pip install" in setup and "jax[tpu]" in setup
    run = _command(launch)
    words = shlex.split(run.split("&&")[-1])
    assert words[:5] == ["{", "LMJAX_DISTRIBUTED=auto", "nohup", "bash", "-c"]
    assert words[5].startswith(".venv/bin/lmjax train") and words[6] == "lmjax"  # $0
    assert words[7:10] == ["configs/tpu-gpt2-124m.yaml", "train.steps=10", "run.dir=runs/r1"]
    assert "train.log" in run and "train.pid" in run
    assert "tail" in _command(logs) and "train.log" in _command(logs)

    console, fetch = gcloud[5], gcloud[6]
    assert console[5:8] == ["t1:lmjax/train.log", "t1:lmjax/train.rc", "runs/tpu/r1/"]
    assert "--recurse" in fetch and "t1:lmjax/runs/r1" in fetch and "--worker=0" in fetch
    assert gcloud[7][4:6] == ["delete", "t1"] and "--quiet" in gcloud[7]


def test_tpu_options_and_single_steps():
    create = dry(TPU, "create", SPOT="1", PROJECT="p9", RUNTIME="v2-alpha-tpuv5-lite")[0]
    assert "--spot" in create and "--project=p9" in create
    assert "--version=v2-alpha-tpuv5-lite" in create
    assert [c[4] for c in dry(TPU, "delete")] == ["delete"]
    # Arguments with spaces or quotes reach the remote shell as one word each.
    launch = dry(TPU, "launch", "c.yaml", "logging.sample_prompt=To be, or")[0]
    words = shlex.split(_command(launch).split("&&")[-1])
    assert "logging.sample_prompt=To be, or" in words


def test_tpu_refuses_unknown_steps_and_missing_config():
    for args in (["frobnicate"], ["launch"], []):
        done = subprocess.run(
            ["bash", str(TPU), *args], env={**os.environ, "DRY_RUN": "1"}, capture_output=True
        )
        assert done.returncode == 2 and b"usage" in done.stderr


def test_gpu_installs_inspects_and_trains_on_every_gpu(tmp_path):
    cmds = dry(GPU, "configs/gpt2-124m.yaml", "train.steps=10", GPUS="4", VENV=str(tmp_path / "v"))
    venv = str(tmp_path / "v")
    assert cmds[0] == ["python3", "-m", "venv", venv]
    assert cmds[2][:3] == [f"{venv}/bin/pip", "install", "-q"] and "-e" in cmds[2]
    assert any(a.startswith("jax[cuda12]") for a in cmds[2])
    assert cmds[3] == [f"{venv}/bin/lmjax", "inspect", "configs/gpt2-124m.yaml", "--mesh", "fsdp=4"]
    assert cmds[4] == [
        f"{venv}/bin/lmjax", "train", "configs/gpt2-124m.yaml", "parallel.mesh=fsdp=4",
        "train.steps=10",
    ]  # fmt: skip
    mesh = dry(GPU, "c.yaml", GPUS="8", MESH="data=2,fsdp=4", VENV=str(tmp_path / "v"))[-1]
    assert "parallel.mesh=data=2,fsdp=4" in mesh


def test_gpu_without_gpus_says_so():
    done = subprocess.run(
        ["bash", str(GPU), "c.yaml"],
        env={**os.environ, "DRY_RUN": "1", "GPUS": "0"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "set GPUS" in done.stderr


def _command(cmd: list[str]) -> str:
    return next(a for a in cmd if a.startswith("--command=")).split("=", 1)[1]


FAKE_GCLOUD = """#!/usr/bin/env bash
# Records each call; the log-streaming ssh fails while $FAIL_LOGS_FILE holds a count > 0,
# and any command containing $FAIL_ON fails. Each fetch of train.rc takes the next status from
# $RC_FILE's lines (else $FAKE_RC); a status "gone" is a preempted VM: that fetch and every
# ssh/scp after it fail until the next create.
echo "$*" >> "$GCLOUD_LOG"
if [[ -n "${FAIL_ON:-}" && "$*" == *"$FAIL_ON"* ]]; then exit 7; fi
if [[ "$*" == *" create "* ]]; then rm -f "$GCLOUD_LOG.gone"; fi
if [[ -f "$GCLOUD_LOG.gone" && ( "$*" == *" ssh "* || "$*" == *" scp "* ) ]]; then exit 255; fi
if [[ "$*" == *" scp "*train.rc* ]]; then  # fetch: the training's exit status
    rc="$FAKE_RC"
    if [[ -s "${RC_FILE:-}" ]]; then rc="$(head -n 1 "$RC_FILE")"; sed -i 1d "$RC_FILE"; fi
    if [[ "$rc" == gone ]]; then touch "$GCLOUD_LOG.gone"; exit 255; fi
    for a in "$@"; do
        if [[ "$a" == */ && "$a" != *:* ]]; then echo "$rc" > "$a/train.rc"; fi
    done
fi
if [[ "$*" == *"--worker=0"* && "$*" == *"tail"* ]]; then
    n=$(cat "$FAIL_LOGS_FILE")
    if [[ $n -gt 0 ]]; then echo $((n - 1)) > "$FAIL_LOGS_FILE"; exit 255; fi
fi
"""


def fake_env(tmp_path, scripts: dict, **env: str) -> dict:
    """Write each fake executable (path -> text) and return an environment that puts
    `tmp_path/bin` first on PATH, logs gcloud calls to `tmp_path/calls.log` and runs for real."""
    for path, text in scripts.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "GCLOUD_LOG": str(tmp_path / "calls.log"),
        "DRY_RUN": "0",
        **env,
    }


def run_with_fake_gcloud(tmp_path, fail_logs: int, fail_on: str = "", rc: int = 0,
                         rcs: tuple = (), calls: list | None = None, **env):  # fmt: skip
    """tpu.sh all for real (DRY_RUN=0) against a fake gcloud on PATH; its calls, in order
    (the verbs; `calls`, if given, gets the whole lines). `rcs`: each attempt's train.rc."""
    bin_dir = tmp_path / "bin"
    (tmp_path / "calls.log").unlink(missing_ok=True)  # this run's calls only
    (tmp_path / "fails").write_text(str(fail_logs))
    (tmp_path / "rcs").write_text("".join(f"{r}\n" for r in rcs))
    # A no-op sleep: no real waits between log retries.
    fakes = {bin_dir / "gcloud": FAKE_GCLOUD, bin_dir / "sleep": "#!/usr/bin/env bash\n"}
    env = fake_env(tmp_path, fakes, FAIL_LOGS_FILE=str(tmp_path / "fails"), FAIL_ON=fail_on,
                   FAKE_RC=str(rc), TMPDIR=str(tmp_path), RC_FILE=str(tmp_path / "rcs"),
                   **env)  # fmt: skip
    done = subprocess.run(
        ["bash", str(TPU), "all", "configs/tpu-gpt2-124m.yaml"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    lines = (tmp_path / "calls.log").read_text().splitlines()
    if calls is not None:
        calls.extend(lines)
    verbs = [c.split()[3] + (" logs" if "tail" in c else "") for c in lines]
    return done, verbs


def test_tpu_all_reconnects_a_dropped_log_stream_then_fetches_and_deletes(tmp_path):
    done, verbs = run_with_fake_gcloud(tmp_path, fail_logs=2)
    assert done.returncode == 0, done.stderr
    assert verbs == ["create", "scp", "ssh", "ssh"] + ["ssh logs"] * 3 + ["scp", "scp", "delete"]
    assert done.stderr.count("reconnecting") == 2
    assert not list(tmp_path.glob("lmjax-src-*.tar.gz"))  # the source archive is removed


def test_tpu_all_gives_up_streaming_after_five_drops_but_still_fetches(tmp_path):
    done, verbs = run_with_fake_gcloud(tmp_path, fail_logs=99)
    assert done.returncode == 0, done.stderr
    assert verbs == ["create", "scp", "ssh", "ssh"] + ["ssh logs"] * 5 + ["scp", "scp", "delete"]


def test_tpu_all_deletes_the_vm_when_a_step_fails(tmp_path):
    done, verbs = run_with_fake_gcloud(tmp_path, fail_logs=0, fail_on="pip install")
    assert done.returncode == 7
    assert verbs == ["create", "scp", "ssh", "delete"]  # install failed: no launch, but deleted


def test_tpu_all_fails_when_the_training_failed(tmp_path):
    done, verbs = run_with_fake_gcloud(tmp_path, fail_logs=0, rc=2)
    assert done.returncode == 1 and "ended with status 2" in done.stderr
    assert verbs == ["create", "scp", "ssh", "ssh", "ssh logs", "scp", "scp", "delete"]
    assert (tmp_path / "runs" / "tpu" / "tpu-run" / "train.rc").read_text().strip() == "2"


ATTEMPT = ["ssh", "ssh logs", "scp", "scp"]  # launch, follow, fetch train.log+rc, fetch the run
SETUP = ["create", "scp", "ssh"]  # create, copy the source, install


def test_tpu_all_recreates_a_failed_or_preempted_tpu_and_resumes(tmp_path):
    """A worker that failed (status 75: a process was lost) or was preempted (the VM answers
    nothing) gets the TPU deleted, created, installed and the training relaunched with
    --resume; the second relaunch succeeds, so `all` ends 0 and deletes the TPU once more."""
    calls: list[str] = []
    done, verbs = run_with_fake_gcloud(tmp_path, 0, rcs=("75", "gone", "0"), calls=calls)
    assert done.returncode == 0, done.stderr
    assert verbs == SETUP + ATTEMPT + (["delete"] + SETUP + ATTEMPT) * 2 + ["delete"], verbs
    assert done.stderr.count("recreating lmjax-tpu and resuming") == 2, done.stderr
    assert "status 75" in done.stderr and "status unknown" in done.stderr
    launches = [c for c in calls if " ssh " in c and "nohup" in c]
    assert len(launches) == 3
    assert "--resume" not in launches[0] and "RESUME_DIR=runs/tpu-run" not in launches[0]
    assert all("RESUME_DIR=runs/tpu-run" in c and "--resume" in c for c in launches[1:])


def test_tpu_all_restarts_a_bounded_number_of_times(tmp_path):
    done, verbs = run_with_fake_gcloud(tmp_path, 0, rcs=("75",) * 5, RESTARTS="1")
    assert done.returncode == 1 and "after 1 restart(s) of 1" in done.stderr, done.stderr
    assert verbs == SETUP + ATTEMPT + ["delete"] + SETUP + ATTEMPT + ["delete"], verbs
    done, verbs = run_with_fake_gcloud(tmp_path, 0, rcs=("75",), RESTARTS="0")
    assert done.returncode == 1 and verbs.count("create") == 1
    done = subprocess.run(["bash", str(TPU), "all", "configs/tpu-gpt2-124m.yaml"],
                          env={**os.environ, "DRY_RUN": "1", "RESTARTS": "many"},
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert done.returncode == 2 and "RESTARTS=many" in done.stderr and not done.stdout


def test_tpu_all_copies_a_run_on_the_vm_disk_back_before_resuming(tmp_path):
    """RUN_DIR relative to ~/lmjax lives on the VM: the copy fetched after the failed attempt
    goes back onto the new VM before the relaunch (a shared absolute RUN_DIR needs no copy)."""
    run = tmp_path / "runs" / "tpu" / "tpu-run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("train: {}\n")  # as the first attempt's fetch left it
    calls: list[str] = []
    done, verbs = run_with_fake_gcloud(tmp_path, 0, rcs=("75", "0"), calls=calls)
    assert done.returncode == 0, done.stderr
    upload = ["ssh", "scp"]  # mkdir -p lmjax/runs, then the copy
    assert verbs == SETUP + ATTEMPT + ["delete"] + SETUP + upload + ATTEMPT + ["delete"], verbs
    copy = next(c for c in calls if " scp --recurse runs/tpu/tpu-run " in c)
    assert "lmjax-tpu:lmjax/runs/" in copy and "--worker=all" in copy
    calls.clear()
    shutil.rmtree(tmp_path / "runs")
    done, verbs = run_with_fake_gcloud(tmp_path, 0, rcs=("75", "0"), RUN_DIR="/mnt/shared/r")
    assert verbs == SETUP + ATTEMPT + ["delete"] + SETUP + ATTEMPT + ["delete"], verbs  # no copy


def test_tpu_launch_resumes_only_a_run_the_worker_has(tmp_path):
    """RESUME=1 (a relaunch) adds --resume where RUN_DIR/config.yaml exists on the worker, so a
    run that never got as far as writing it starts afresh instead of failing; HEARTBEAT sets
    LMJAX_HEARTBEAT_TIMEOUT for the workers."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    lmjax = '#!/usr/bin/env bash\necho "fake lmjax: $* heartbeat=$LMJAX_HEARTBEAT_TIMEOUT"\n'
    fakes = {bin_dir / "gcloud": REMOTE_GCLOUD, home / "lmjax" / ".venv" / "bin" / "lmjax": lmjax}
    env = fake_env(tmp_path, fakes, FAKE_HOME=str(home), RUN_NAME="r5", RESUME="1", HEARTBEAT="30")

    def launch_and_wait() -> str:
        done = subprocess.run(["bash", str(TPU), "launch", "c.yaml"], env=env, capture_output=True)
        assert done.returncode == 0, done.stderr
        for _ in range(100):
            if (home / "lmjax" / "train.rc").is_file():
                break
            time.sleep(0.05)
        return (home / "lmjax" / "train.log").read_text()

    assert launch_and_wait().strip() == "fake lmjax: train c.yaml run.dir=runs/r5 heartbeat=30"
    (home / "lmjax" / "runs" / "r5").mkdir(parents=True)
    (home / "lmjax" / "runs" / "r5" / "config.yaml").write_text("train: {}\n")
    assert "run.dir=runs/r5 --resume heartbeat=30" in launch_and_wait()


REMOTE_GCLOUD = """#!/usr/bin/env bash
# A fake gcloud whose ssh runs --command=... in $FAKE_HOME with bash, as a worker's login
# shell would; other calls are only recorded.
echo "$*" >> "$GCLOUD_LOG"
for arg in "$@"; do
    if [[ "$arg" == --command=* ]]; then cd "$FAKE_HOME" && exec bash -c "${arg#--command=}"; fi
done
"""
FAKE_LMJAX = """#!/usr/bin/env bash
echo "fake lmjax: $*"
sleep 1
exit 3
"""


def test_tpu_launch_and_logs_follow_the_training_on_the_worker(tmp_path):
    """launch and logs run their remote commands for real (in a fake worker home): logs finds
    the pid launch wrote, streams train.log until the training exits, and reports its status.
    (launch once wrote train.pid into ~ instead of ~/lmjax, so logs failed at once and `all`
    deleted the TPU under a running training.)"""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    fakes = {bin_dir / "gcloud": REMOTE_GCLOUD,
             home / "lmjax" / ".venv" / "bin" / "lmjax": FAKE_LMJAX}  # fmt: skip
    env = fake_env(tmp_path, fakes, FAKE_HOME=str(home), RUN_NAME="r2")

    def tpu(*args):
        return subprocess.run(["bash", str(TPU), *args], env=env, capture_output=True, text=True)

    assert tpu("launch", "c.yaml", "logging.sample_prompt=To be, or").returncode == 0
    assert (home / "lmjax" / "train.pid").is_file() and not (home / "train.pid").exists()
    logs = tpu("logs")
    assert logs.returncode == 0, logs.stderr
    assert "fake lmjax: train c.yaml logging.sample_prompt=To be, or run.dir=runs/r2" in logs.stdout
    assert "lmjax train exited with status 3" in logs.stdout
    assert (home / "lmjax" / "train.rc").read_text().strip() == "3"


FAKE_UV = """#!/usr/bin/env bash
echo "uv $*" >> "$HOME/uv.log"
if [[ "$1 $2" == "pip install" ]]; then mkdir -p .venv/bin && touch .venv/bin/lmjax; fi
"""
SYSTEM_PYTHON = """#!/usr/bin/env bash
echo "python3 $*" >> "$HOME/python3.log"
exit 1  # Ubuntu 22.04's python3 is 3.10; lmjax needs >= 3.11
"""


def test_tpu_install_builds_the_venv_on_a_python_lmjax_supports(tmp_path):
    """install runs for real: git archive, scp (recorded), and the worker's setup command in a
    fake home whose python3 stands for the TPU images' 3.10 (the project requires >= 3.11;
    install once made its venv with that python3, so pip install -e . could not succeed)."""
    import tarfile

    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    fakes = {bin_dir / "gcloud": REMOTE_GCLOUD, bin_dir / "python3": SYSTEM_PYTHON,
             home / ".local" / "bin" / "uv": FAKE_UV}  # fmt: skip
    env = fake_env(tmp_path, fakes, FAKE_HOME=str(home), HOME=str(home), TMPDIR=str(tmp_path))
    with tarfile.open(home / "lmjax.tar.gz", "w:gz"):
        pass
    done = subprocess.run(["bash", str(TPU), "install"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not (home / "python3.log").exists()
    uv = (home / "uv.log").read_text().splitlines()
    venv = next(line.split() for line in uv if line.startswith("uv venv"))
    version = venv[venv.index("--python") + 1]
    assert tuple(map(int, version.split("."))) >= (3, 11), venv
    install = next(line for line in uv if line.startswith("uv pip install"))
    assert "jax[tpu]>=0.10.2,<0.13" in install and install.endswith("-e .")
    assert (home / "lmjax" / ".venv" / "bin" / "lmjax").exists()
    assert not list(tmp_path.glob("lmjax-src-*.tar.gz"))


def test_tpu_run_directory_is_one_setting_for_launch_and_fetch():
    """A multi-host slice needs run.dir on a shared mount; launch used to append its own
    run.dir=runs/RUN_NAME after the user's, overriding it, and fetch copied that path anyway.
    RUN_DIR now sets both; a run.dir= argument is refused with that fix."""
    launch = dry(TPU, "launch", "c.yaml", RUN_DIR="/mnt/shared/r3")[0]
    words = shlex.split(_command(launch).split("&&")[-1])
    assert [w for w in words if w.startswith("run.dir=")] == ["run.dir=/mnt/shared/r3"]
    fetch = [c for c in dry(TPU, "fetch", TPU_NAME="t3", RUN_DIR="/mnt/shared/r3") if "scp" in c]
    assert any("t3:/mnt/shared/r3" in c for c in fetch), fetch
    fetch = [c for c in dry(TPU, "fetch", TPU_NAME="t3", RUN_NAME="r4") if "scp" in c]
    assert any("t3:lmjax/runs/r4" in c for c in fetch), fetch
    done = subprocess.run(
        ["bash", str(TPU), "launch", "c.yaml", "run.dir=/mnt/x"],
        env={**os.environ, "DRY_RUN": "1"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "RUN_DIR=/mnt/x" in done.stderr, done.stderr


def test_gpu_refuses_a_python_older_than_the_project_needs(tmp_path):
    """train.sh made its venv with whatever python3 was first on PATH; lmjax needs >= 3.11, so
    an older one failed later inside pip. It now says so first, and PYTHON picks another."""
    (tmp_path / "python3").write_text("#!/usr/bin/env bash\nexit 1\n")  # an old Python
    (tmp_path / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "GPUS": "1", "DRY_RUN": "0"}
    done = subprocess.run(
        ["bash", str(GPU), "c.yaml"],
        env={**env, "VENV": str(tmp_path / "v")},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "3.11" in done.stderr and "PYTHON=" in done.stderr
    assert not (tmp_path / "v").exists()
    cmds = dry(GPU, "c.yaml", GPUS="1", VENV=str(tmp_path / "v"), PYTHON="python3.12")
    assert cmds[0] == ["python3.12", "-m", "venv", str(tmp_path / "v")]


def test_tpu_all_refuses_a_config_the_workers_will_not_have_before_creating_anything(tmp_path):
    """The workers get `git archive HEAD`: a config missing from HEAD (a typo, or not committed)
    used to fail only after the TPU was created and installed (billed minutes)."""
    done = subprocess.run(
        ["bash", str(TPU), "all", "configs/no-such.yaml"],
        env={**os.environ, "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "configs/no-such.yaml" in done.stderr, done.stderr
    assert "HEAD" in done.stderr and "gcloud" not in done.stdout
    done = subprocess.run(
        ["bash", str(TPU), "all"], env={**os.environ, "DRY_RUN": "1"}, capture_output=True
    )
    assert done.returncode == 2 and b"usage" in done.stderr and b"gcloud" not in done.stdout
