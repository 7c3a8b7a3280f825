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

Implicit rank promotion is an error, so no broadcast in lmjax is silent; float32 matmuls run at
full precision, so the same tolerances hold on GPUs (which default to TF32) as on CPUs.
"""

import glob
import os
from pathlib import Path

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


if "JAX_PLATFORMS" not in os.environ and not _accelerator_attached():
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402  (after JAX_PLATFORMS)

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


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
        if module is not None and hasattr(module, "start_in_background"):
            selected.setdefault(module, set()).add(item.originalname)
    for module, names in selected.items():
        module.start_in_background(names)
