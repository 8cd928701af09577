"""A worker's broker connection, lost with a message in hand (`workers.broker`), against a
throwaway Redis that is killed: closing the lost connection and acking the message it held
raise only connection errors, which kombu and Celery handle (the consumer reconnects), never
the AttributeError that made a control worker exit in
`test_faults.py::test_redis_flushed_and_restarted_empty_every_goal_completes`."""

from __future__ import annotations

import logging

import pytest
from kombu import Connection, Exchange, Queue
from kombu.common import ignore_errors

from tests.integration.cluster import RedisServer
from workers import broker

pytestmark = pytest.mark.integration


def _lost_with_a_message_in_hand(redis_server: RedisServer):  # noqa: ANN202
    """A connection whose broker died while a channel held an unacked message, in the state
    Celery's consumer leaves it in: collected (its transport detached), that channel open."""
    conn = Connection(redis_server.url)
    queue = Queue("tasks", Exchange("tasks"), "tasks")
    with conn.Producer() as producer:
        producer.publish({"task": 1}, exchange="", routing_key="tasks", declare=[queue])
    channel = conn.channel()
    message = queue(channel).get(no_ack=False)
    assert message is not None and message.payload == {"task": 1}
    redis_server.kill()
    conn._do_close_transport()  # what Connection.collect() does once closing its channels failed
    return conn, channel, message


def test_a_lost_connection_closes_and_acks_with_connection_errors_only(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    broker.install()
    conn, channel, message = _lost_with_a_message_in_hand(redis_server)

    with pytest.raises(conn.connection_errors):
        channel.close()
    ignore_errors(conn, channel.close)  # Celery's close of a lost connection: passes now

    with caplog.at_level(logging.CRITICAL):  # the task finished after the loss: its ack
        message.ack_log_error(logging.getLogger("test"), conn.connection_errors)
    assert "Couldn't ack" in caplog.text


def test_install_is_idempotent_and_a_live_connection_works(redis_server: RedisServer) -> None:
    broker.install()
    broker.install()
    from kombu.transport import redis as kombu_redis

    patched = kombu_redis.Channel._connparams
    assert not hasattr(patched.__wrapped__, "__wrapped__")  # wrapped once
    with Connection(redis_server.url) as conn:
        queue = conn.SimpleQueue("live")
        queue.put({"n": 2})
        message = queue.get(timeout=5)
        assert message.payload == {"n": 2}
        message.ack()
        queue.close()
