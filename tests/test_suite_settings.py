"""The suite's own compile settings (tests/conftest.py): which XLA flags a run gets, and when not.

jaxlib aborts at its first device use on a flag it does not know, so the code generator's flags
must be added only for the releases that have them, and never over a user's own choice.
"""

from __future__ import annotations

import importlib.metadata
import os

import conftest
import pytest

LEVEL_0 = f"{conftest.OPT_LEVEL_FLAG}=0"


@pytest.fixture
def defaults(monkeypatch):
    monkeypatch.delenv("LMJAX_TEST_FAST_COMPILE", raising=False)


def test_jaxlib_0_10_gets_level_0_and_the_older_emitter(defaults):
    flags = conftest.fast_compile_flags("--xla_force_host_platform_device_count=8", "0.10.2")
    assert flags.split() == [
        "--xla_force_host_platform_device_count=8",
        LEVEL_0,
        *conftest.CODEGEN_FLAGS,
    ]


@pytest.mark.parametrize("jaxlib", ["0.11.2", "0.12.0.1"])
def test_later_checked_releases_get_the_one_codegen_flag_they_have(defaults, jaxlib):
    split = "--xla_cpu_parallel_codegen_split_count=1"
    assert conftest.fast_compile_flags("", jaxlib).split() == [LEVEL_0, split]


@pytest.mark.parametrize("jaxlib", ["0.11.1", "0.12.1", "1.0.1", "0.9.2"])
def test_other_releases_get_only_level_0(defaults, jaxlib):
    assert conftest.fast_compile_flags("", jaxlib).split() == [LEVEL_0]


def test_a_level_set_already_or_the_opt_out_leaves_the_flags_alone(defaults, monkeypatch):
    own = f"{conftest.OPT_LEVEL_FLAG}=2"
    assert conftest.fast_compile_flags(own, "0.10.2") == own
    monkeypatch.setenv("LMJAX_TEST_FAST_COMPILE", "0")
    assert conftest.fast_compile_flags("--xla_cpu_max_isa=AVX2", "0.10.2") == (
        "--xla_cpu_max_isa=AVX2"
    )


def test_this_run_has_them_when_it_compiles_for_the_cpu():
    """What this process (and every subprocess, by inheritance) was given at start."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    cpu = os.environ.get("JAX_PLATFORMS") == "cpu"
    if not cpu or os.environ.get("LMJAX_TEST_FAST_COMPILE") == "0":
        pytest.skip("not a CPU run with the suite's compile settings")
    if LEVEL_0 not in flags:
        pytest.skip("XLA_FLAGS set an optimization level of their own")
    jaxlib = importlib.metadata.version("jaxlib")
    ours = set(conftest.codegen_flags(jaxlib))
    assert set(conftest.CODEGEN_FLAGS) & set(flags) == ours, flags
