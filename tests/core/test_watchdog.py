"""The consume watchdog's decision (`workers.watchdog.ConsumeWatchdog`), on a clock the test
moves. On a real broker and a real worker: tests/integration/test_consume_watchdog.py."""

from __future__ import annotations

import pytest

from workers.watchdog import ConsumeWatchdog


class World:
    def __init__(self) -> None:
        self.now, self.waiting, self.running = 0.0, 0, 0

    def dog(self, concurrency: int = 1, stuck_after: float = 10) -> ConsumeWatchdog:
        return ConsumeWatchdog(lambda: self.waiting, lambda: self.running, concurrency,
                               stuck_after, clock=lambda: self.now)  # fmt: skip


def _look(world: World, dog: ConsumeWatchdog, until: float, step: float = 1) -> str | None:
    while world.now < until:
        world.now += step
        why = dog.check()
        if why:
            return why
    return None


def test_waiting_work_not_taken_by_an_idle_worker_is_reported_after_stuck_after() -> None:
    world = World()
    dog = world.dog(stuck_after=10)
    world.waiting = 3
    assert _look(world, dog, until=10) is None  # first seen at 1 s: 9 s so far
    why = _look(world, dog, until=12)
    assert why is not None and "3 message(s)" in why and "0 of 1 tasks" in why


def test_a_received_message_restarts_the_clock() -> None:
    world = World()
    dog = world.dog(stuck_after=10)
    world.waiting = 1
    assert _look(world, dog, until=8) is None
    dog.received()
    assert _look(world, dog, until=17) is None  # 9 s since the receipt
    assert _look(world, dog, until=20) is not None


@pytest.mark.parametrize("break_", ["empty", "busy", "broker down"])
def test_any_break_in_the_stretch_restarts_the_clock(break_: str) -> None:
    world = World()
    dog = world.dog(concurrency=2, stuck_after=10)
    world.waiting = 2
    assert _look(world, dog, until=8) is None
    if break_ == "empty":
        world.waiting = 0
    elif break_ == "busy":
        world.running = 2  # every slot taken: the messages wait for it, rightly
    else:
        world.waiting = None  # type: ignore[assignment]  # the broker did not answer
    assert _look(world, dog, until=30) is None
    world.waiting, world.running = 2, 1  # one slot free again
    assert _look(world, dog, until=40) is None  # a fresh stretch from 31 s
    assert _look(world, dog, until=42) is not None


def test_stuck_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stuck_after"):
        ConsumeWatchdog(lambda: 0, lambda: 0, 1, stuck_after=0)


def test_a_gap_between_looks_starts_a_fresh_stretch() -> None:
    """A process stopped (SIGSTOP, a suspended machine) saw nothing in between: a long gap
    between two looks is no evidence that the worker failed to consume."""
    world = World()
    dog = ConsumeWatchdog(lambda: world.waiting, lambda: world.running, 1, 10,
                          clock=lambda: world.now, max_gap=5)  # fmt: skip
    world.waiting = 1
    assert _look(world, dog, until=3) is None
    world.now += 60  # stopped for a minute
    assert dog.check() is None
    assert _look(world, dog, until=72) is None  # 9 s into the fresh stretch
    assert _look(world, dog, until=75) is not None
