"""The consume watchdog (`workers/watchdog.py`) on a real Redis and a real cluster: a
generation worker that stops consuming (its consumer cancelled: alive, answering control
commands, taking nothing) exits with code 70 once its queue has held work for
`AGENTLOOP_WORKER_WATCHDOG_SECONDS`, and the worker its supervisor starts in its place
finishes the goal. Every fault test runs with the watchdog at 10 s (`cluster.FAST_SETTINGS`),
and `Cluster.check_invariants` fails on any worker that exits on its own: none may be stopped
by mistake there."""

from __future__ import annotations

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

from tests.integration.cluster import FAST_SETTINGS, Cluster, RedisServer, wait_for
from workers.watchdog import EXIT_CODE, queue_waiting

pytestmark = pytest.mark.integration


def test_queue_waiting_counts_ready_messages_and_none_when_the_broker_is_down(
    redis_server: RedisServer,
) -> None:
    app = Celery("watchdog-test", broker=redis_server.url)
    queue = Queue("gen.test", Exchange("gen.test"), "gen.test")
    with Connection(redis_server.url) as conn, conn.Producer() as producer:
        for n in range(3):
            producer.publish({"n": n}, exchange="", routing_key="gen.test", declare=[queue])
    assert queue_waiting(app, ["gen.test", "gen.nobody-sent-here"]) == 3
    with Connection(redis_server.url) as conn:
        assert queue(conn.channel()).get(no_ack=True) is not None
    assert queue_waiting(app, ["gen.test"]) == 2
    redis_server.kill()
    assert queue_waiting(app, ["gen.test"]) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_that_stops_consuming_exits_and_its_replacement_finishes_the_goal(
    cluster: Cluster,
) -> None:
    stuck_after = float(FAST_SETTINGS["AGENTLOOP_WORKER_WATCHDOG_SECONDS"])
    gen = cluster.current("gen")
    replies = cluster.celery().control.cancel_consumer(
        "gen.tiny-dit", destination=[gen.celery_name], reply=True, timeout=5)
    assert replies and "ok" in next(iter(replies[0].values())), replies
    goal = cluster.create_goal(budget=4, fanout=4)

    wait_for(lambda: not gen.alive(), 60 + stuck_after, "the worker that takes nothing to exit")
    assert gen.popen.returncode == EXIT_CODE
    assert "is not consuming" in gen.log.read_text(errors="replace")
    assert cluster.goal(goal)["status"] not in {"done", "failed"}  # it waited for a worker
    cluster.killed.add(gen.name)  # its exit is what this test asks for, not a fault's damage

    cluster.start("gen")  # what the supervisor (Compose's restart policy) does
    assert cluster.wait_goals_ended([goal], timeout=120) == {goal: "done"}
    cluster.check_invariants()
