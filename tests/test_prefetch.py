"""`lmjax.data.prefetch.Prefetch`: the next batch is built while the step runs.

Overlap is shown by events, not wall-clock thresholds: step k waits (bounded) for the producer
to have started batch k + 1, which only a producer running ahead can do. No jax: ~1 s.
"""

from __future__ import annotations

import threading

import pytest

from lmjax.data.prefetch import Prefetch
from lmjax.errors import ConfigError

WAIT_S = 10.0  # an upper bound for a thread to get going, never a measurement


def test_the_next_batch_is_built_while_the_step_runs():
    steps = range(3, 8)
    started = {s: threading.Event() for s in steps}
    events: list[str] = []

    def make(step):
        events.append(f"batch {step} started")
        started[step].set()
        return {"step": step}

    with Prefetch(make, steps, depth=1) as batches:
        for step in steps:
            got, batch, waited = batches.next()
            assert got == step and batch == {"step": step} and waited >= 0.0
            if step + 1 in started:  # the step runs until its successor's batch is underway
                assert started[step + 1].wait(WAIT_S), f"batch {step + 1} waited for step {step}"
            events.append(f"step {step} finished")
    for step in steps[:-1]:
        assert events.index(f"batch {step + 1} started") < events.index(f"step {step} finished")


def test_it_never_builds_more_than_depth_ahead():
    made: list[int] = []
    third = threading.Event()

    def make(step):
        made.append(step)
        if len(made) == 3:
            third.set()
        return step

    batches = Prefetch(make, range(100), depth=2)
    try:
        assert third.wait(WAIT_S)  # two queued, the third built and waiting for room
        threading.Event().wait(0.3)  # time for a fourth, were the queue unbounded
        assert made == [0, 1, 2]
        assert [batches.next()[1] for _ in range(5)] == [0, 1, 2, 3, 4]  # in order
    finally:
        batches.close()


@pytest.mark.parametrize("error", [ValueError("token id 99 at position 7"), KeyboardInterrupt()])
def test_an_error_in_the_producer_surfaces_at_its_step(error):
    made = []

    def make(step):
        made.append(step)
        if step == 2:
            raise error
        return step

    with Prefetch(make, range(10)) as batches:
        assert [batches.next()[1] for _ in range(2)] == [0, 1]
        with pytest.raises(type(error)) as caught:
            batches.next()
    assert caught.value is error  # the original exception, message and all
    assert made == [0, 1, 2]  # the producer stopped there


def test_leaving_early_stops_the_thread():
    with Prefetch(lambda s: s, range(1000), depth=2) as batches:
        batches.next()
        assert "lmjax-prefetch" in {t.name for t in threading.enumerate()}
    assert "lmjax-prefetch" not in {t.name for t in threading.enumerate()}


def test_depth_must_be_positive():
    with pytest.raises(ConfigError, match="prefetch depth"):
        Prefetch(lambda s: s, range(3), depth=0)
