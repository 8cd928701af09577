"""A fix for kombu's Redis transport that keeps a worker alive through a broker restart.

When Redis goes away while a worker holds an unacknowledged message (any task it is running:
late acks), Celery's consumer collects the broken connection, which detaches the transport
from its connection (`transport.client = None`), and then closes it. A channel not yet closed
by then (closing the first one failed part-way on the dead socket) restores its unacked
messages on close, which rebuilds its Redis pool from `transport.client` — None — and raises
AttributeError. That is not one of the transport's connection errors, so Celery's "ignore
errors while closing" lets it through, logs `Unrecoverable error`, and the worker exits. The
same happens to the running task's ack when it finishes: the worker that should reconnect
is gone, and with it every goal's next step (seen in `tests/integration/test_faults.py`,
Redis flushed then restarted, about one run in twenty under load; kombu 5.7.0, the latest).

`install()` makes such a channel raise Redis's ConnectionError instead: a connection error,
which kombu and Celery already handle (the close goes on, the ack is logged as not done, the
consumer reconnects). Nothing is lost by not restoring: Redis hands the message back after
the visibility timeout, and our sweep resends whatever it stood for long before that (a
message is only a hint; the database says what is left to do).
"""

from __future__ import annotations

from typing import Any

_installed = False


def install() -> None:
    """Patch `kombu.transport.redis.Channel` once per process (idempotent)."""
    global _installed
    if _installed:
        return
    from kombu.transport import redis as kombu_redis
    from redis.exceptions import ConnectionError as RedisConnectionError

    original = kombu_redis.Channel._connparams

    def _connparams(self: Any, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection is None or self.connection.client is None:
            raise RedisConnectionError("the broker connection of this channel was closed")
        return original(self, asynchronous=asynchronous)

    _connparams.__wrapped__ = original  # type: ignore[attr-defined]
    kombu_redis.Channel._connparams = _connparams
    _installed = True
