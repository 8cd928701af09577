"""The consume watchdog: a worker alive but no longer consuming exits, for its supervisor to
restart it.

The fault tests cover a worker that dies (its leases lapse, the sweep takes its work back), a
broker that restarts or loses its messages, a database that restarts. One failure they do not
cover on their own: a worker whose process is alive and answers nothing wrong, but whose
consumer has stopped taking messages (a class of Celery/kombu bugs after broker reconnects).
Its messages wait in the queue, the sweep resends them into the same queue, and a goal that
only this worker serves waits for ever. A restart fixes it, but a process that is alive is
never restarted by Compose's `restart:` policy.

So every worker runs this watchdog, a thread of its main process. Every `interval` seconds it
asks the broker how many messages wait in the queues the worker was started to consume. It
exits the process (code `EXIT_CODE`) once messages have been seen waiting, without a break,
for `stuck_after` seconds, while the worker had a free slot (fewer tasks running than its
concurrency) and received no message at all. A busy worker, a worker that received anything,
an empty queue, or a broker that does not answer (an outage the consumer handles itself)
resets the clock: only a worker that could take work, has work waiting for it, and takes none
is stopped. The messages it held unacknowledged come back (Redis' visibility timeout; the
sweep resends what they stood for far sooner), and its candidates' leases lapse as for any
dead worker.

`AGENTLOOP_WORKER_WATCHDOG_SECONDS` sets `stuck_after` (0: off). A worker drained on purpose
by `celery control cancel_consumer` would look stuck: stop it instead (a warm shutdown).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

_started = False

EXIT_CODE = 70
"""The exit status of a worker the watchdog stopped (EX_SOFTWARE): its supervisor restarts it."""


class ConsumeWatchdog:
    """Decides, from what it is told, whether the worker has stopped consuming.

    ``waiting()`` returns the messages waiting in the worker's queues (None: the broker did
    not answer); ``running()`` the tasks the worker runs now; ``clock`` is monotonic seconds.
    ``received()`` is called for every message the worker receives.
    """

    def __init__(
        self, waiting: Callable[[], int | None], running: Callable[[], int], concurrency: int,
        stuck_after: float, clock: Callable[[], float] = time.monotonic,
        max_gap: float | None = None,
    ) -> None:  # fmt: skip
        if stuck_after <= 0:
            raise ValueError(f"stuck_after must be positive, not {stuck_after!r}")
        self.waiting, self.running, self.clock = waiting, running, clock
        self.concurrency, self.stuck_after = max(1, concurrency), stuck_after
        self.max_gap = max_gap
        """Two looks further apart than this (the process was stopped, the machine slept)
        do not make a stretch: what happened between them was not seen."""
        self._since: float | None = None
        """When the current unbroken stretch of 'work waiting, a free slot, nothing taken'
        began (None: not in one)."""
        self._last: float | None = None

    def received(self) -> None:
        """The worker took a message: it consumes."""
        self._since = None

    def check(self) -> str | None:
        """One look: why the worker should be restarted, or None."""
        waiting = self.waiting()
        running = self.running()
        now = self.clock()
        last, self._last = self._last, now
        if not waiting or running >= self.concurrency:  # None, 0, or busy: nothing to judge
            self._since = None
            return None
        if self._since is None or (self.max_gap is not None and last is not None
                                   and now - last > self.max_gap):  # fmt: skip
            self._since = now
            return None
        stalled = now - self._since
        if stalled < self.stuck_after:
            return None
        return (
            f"{waiting} message(s) have waited in its queues for {stalled:.0f} s while it ran "
            f"{running} of {self.concurrency} tasks and received none"
        )


def queue_waiting(app: Any, queues: Iterable[str]) -> int | None:
    """Messages ready in ``queues`` on the app's broker (None when the broker does not
    answer). A queue the broker does not hold (Redis drops an empty list) counts 0."""
    from kombu.exceptions import ChannelError

    total = 0
    try:
        with app.connection_for_read() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=5)
            channel = conn.default_channel
            for queue in queues:
                try:
                    total += int(channel.queue_declare(queue=queue, passive=True).message_count)
                except ChannelError:
                    channel = conn.channel()  # a failed passive declare may close the channel
    except Exception:  # noqa: BLE001 - an outage is the consumer's to handle, not ours
        log.debug("watchdog: the broker did not answer", exc_info=True)
        return None
    return total


def start(consumer: Any, stuck_after: float) -> threading.Thread | None:
    """Watch a started Celery worker (``consumer``: the ``worker_ready`` signal's sender):
    the queues it was started to consume, its concurrency, its active requests. Returns the
    watching thread (None when ``stuck_after`` is 0)."""
    global _started
    if stuck_after <= 0 or _started:  # worker_ready comes again after a consumer restart
        return None
    _started = True
    from celery import signals
    from celery.worker import state

    app = consumer.app
    queues = sorted(q.name for q in app.amqp.queues.consume_from.values())
    concurrency = int(getattr(consumer.controller, "concurrency", 1) or 1)
    every = max(0.5, min(5.0, stuck_after / 4))
    dog = ConsumeWatchdog(
        lambda: queue_waiting(app, queues), lambda: len(state.active_requests),
        concurrency, stuck_after, max_gap=3 * every + 5,
    )  # fmt: skip
    signals.task_received.connect(lambda **_: dog.received(), weak=False)

    def run() -> None:
        while True:
            time.sleep(every)
            try:
                why = dog.check()
            except Exception:  # noqa: BLE001 - the watchdog must never be what kills a worker
                log.exception("watchdog check failed")
                continue
            if why:
                log.critical("worker %s is not consuming: %s; exiting (%d) for its supervisor "
                             "to restart it", consumer.hostname, why, EXIT_CODE)
                logging.shutdown()
                os._exit(EXIT_CODE)  # the consumer may be wedged: no graceful shutdown

    thread = threading.Thread(target=run, name="agentloop-watchdog", daemon=True)
    thread.start()
    log.info("watchdog on: %s, restart after %.0f s of waiting work not taken", queues, stuck_after)
    return thread
