"""Batching across goals on a Celery generation worker: a running generation task takes the
other generation messages waiting in its own queue and runs their candidates with its own, as
one engine batch.

A generation message carries one goal's fan-out (a few candidates). A worker that ran each
message alone would run batches of a few rows while dozens wait behind them. So the task, once
it starts, takes further messages from its queue (`basic_get`, a synchronous get on its own
broker connection) until it holds `gen_max_batch` candidates, the queue is empty and
`gen_max_wait_ms` has passed since it started, or a message is not a generation task. The
worker's own prefetch stays at one message: what is not taken stays in the broker for any
worker, so several GPU workers share a queue fairly and a dead one holds at most its batch.

Acknowledgement follows the task's own (late acks): a message taken in is acknowledged only
after the batch has been recorded; if the batch raises, the messages go back to the head of
the queue. If the worker dies in between, they sit unacknowledged in the broker until its
visibility timeout, while their candidates' leases lapse and the sweep takes them back, as
for the task's own message (docs/reliability.md). A message is only a hint: a duplicate, or
one that comes back after its candidates finished, claims nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from kombu.message import Message
from kombu.serialization import prepare_accept_content

from agentloop.dispatch import generation_queue

log = logging.getLogger(__name__)

GENERATE_TASK = "agentloop.generate"
POLL_SECONDS = 0.005
"""How often an empty queue is asked again while the wait lasts."""


@dataclass
class Taken:
    """What a task took in from its queue: the candidate ids, the messages that carried them."""

    ids: list[str] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)


def candidate_ids_of(message: Message) -> list[str] | None:
    """The candidate ids a generation message carries (Celery's message protocol 2: headers
    name the task, the body is `[args, kwargs, embed]`); None when it is not one."""
    if (message.headers or {}).get("task") != GENERATE_TASK:
        return None
    try:
        args, kwargs, _ = message.decode()
        ids = args[0] if args else kwargs["candidate_ids"]
    except Exception:  # noqa: BLE001 - a malformed message is Celery's to report, not ours
        return None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return None
    return ids


def put_back(message: Message) -> None:
    """Return a taken message to the head of its queue, where it came from (Redis: the
    transport's own restore, as for a message whose visibility timeout passed; other brokers:
    a requeueing reject)."""
    restore = getattr(message.channel.qos, "restore_by_tag", None)
    if restore is None:
        message.reject(requeue=True)
        return
    restore(message.delivery_tag)  # moves it from the unacked set back into the queue, atomically
    message.ack()  # forgets it on this channel; the broker no longer holds it as unacked


class Coalescer:
    """Takes waiting generation messages for a running task (see the module docstring)."""

    def __init__(self, app: Celery, max_rows: int, max_wait_s: float):
        self.app, self.max_rows, self.max_wait_s = app, max(1, max_rows), max(0.0, max_wait_s)

    @contextmanager
    def take(self, queue: str | None, held: int) -> Iterator[Taken]:
        """Take messages from `queue` while the task holds fewer than `max_rows` candidates
        (`held` of its own); yield them. On a clean exit they are acknowledged; if the block
        raises they are put back at the head of the queue, and the exception goes on."""
        taken = Taken()
        if not queue or held >= self.max_rows:
            yield taken
            return
        conn = self.app.connection_for_read()
        try:
            self._drain(conn, queue, held, taken)
            try:
                yield taken
            except BaseException:
                self._settle(taken, put_back, "put back", reverse=True)  # the first ends first
                raise
            self._settle(taken, lambda m: m.ack(), "acknowledge")
        finally:
            try:
                conn.release()  # closing the channel restores whatever is still unacked
            except Exception:  # noqa: BLE001 - the broker went away; its messages stay unacked
                log.warning("could not close the coalescing connection", exc_info=True)

    def _drain(self, conn: Any, queue: str, held: int, taken: Taken) -> None:
        deadline = time.monotonic() + self.max_wait_s
        accept = prepare_accept_content(self.app.conf.accept_content)
        rows = held
        try:
            channel = conn.default_channel
            while rows < self.max_rows:
                raw = channel.basic_get(queue, no_ack=False)
                if raw is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    time.sleep(min(POLL_SECONDS, left))
                    continue
                message = raw if isinstance(raw, Message) else channel.message_to_python(raw)
                message.accept = accept  # json only, as the worker itself accepts
                ids = candidate_ids_of(message)
                if ids is None or (taken.ids and rows + len(ids) > self.max_rows):
                    put_back(message)  # not ours to run, or it would not fit: it runs next
                    break
                taken.messages.append(message)
                taken.task_ids.append(str((message.headers or {}).get("id", "")))
                taken.ids.extend(ids)
                rows += len(ids)
        except conn.connection_errors:
            # The broker went away while we drained: run what we have; whatever we took and
            # cannot settle stays unacked in the broker (a hint; the sweep has the truth).
            log.warning("stopped taking messages from %s: broker error", queue, exc_info=True)
        if taken.messages:
            log.info("coalesced %d more generation message(s), %d candidate(s), from %s",
                     len(taken.messages), len(taken.ids), queue)

    @staticmethod
    def _settle(taken: Taken, how: Any, what: str, reverse: bool = False) -> None:
        for message in reversed(taken.messages) if reverse else taken.messages:
            try:
                how(message)
            except Exception:  # noqa: BLE001 - left unacked: redelivered later, claims nothing
                log.warning("could not %s a coalesced message", what, exc_info=True)


def queue_of(delivery_info: dict[str, Any] | None) -> str | None:
    """The generation queue a task's message came from (`gen.<model>`), or None (called
    directly, eagerly, or from another queue: nothing to take)."""
    routing_key = (delivery_info or {}).get("routing_key")
    if isinstance(routing_key, str) and routing_key.startswith(generation_queue("")):
        return routing_key
    return None
