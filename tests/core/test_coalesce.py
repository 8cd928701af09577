"""Taking waiting generation messages into a running task (`workers.coalesce`), against this
machine's Redis (a database of its own, a fresh queue name per test): what is taken, what is
left, and that a batch that raises puts its messages back where they were."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.conftest import REDIS_URL
from workers.coalesce import Coalescer, queue_of

URL = REDIS_URL.rsplit("/", 1)[0] + "/9"


@pytest.fixture
def app() -> Iterator:  # noqa: ANN201 - celery.Celery
    import redis
    from celery import Celery

    try:
        redis.Redis.from_url(URL).ping()
    except redis.ConnectionError:
        pytest.fail(f"Redis is not reachable at {URL}; start it (see .ci/run)")
    app = Celery("coalesce-test", broker=URL)
    app.conf.accept_content = ["json"]
    yield app
    app.close()


@pytest.fixture
def model() -> Iterator[str]:
    import redis

    name = f"coalesce-{uuid.uuid4().hex[:8]}"
    yield name
    client = redis.Redis.from_url(URL)
    for key in client.scan_iter(f"*gen.{name}*"):
        client.delete(key)


def _send(app, model: str, ids: list[str]) -> None:  # noqa: ANN001
    app.send_task("agentloop.generate", args=[ids], queue=f"gen.{model}")


def _waiting(app, model: str) -> list[list[str]]:  # noqa: ANN001
    """The candidate ids of every message in the queue, head first (without taking them)."""
    import base64
    import json

    import redis

    raw = redis.Redis.from_url(URL).lrange(f"gen.{model}", 0, -1)
    return [json.loads(base64.b64decode(json.loads(m)["body"]))[0][0]
            for m in reversed(raw)]


def _unacked(app) -> int:  # noqa: ANN001
    import redis

    return int(redis.Redis.from_url(URL).hlen("unacked"))


def test_a_task_takes_waiting_messages_up_to_its_rows_and_acks_them(app, model: str) -> None:  # noqa: ANN001
    unacked = _unacked(app)
    for k in range(5):
        _send(app, model, [f"{k}a", f"{k}b", f"{k}c", f"{k}d"])
    with Coalescer(app, max_rows=12, max_wait_s=0).take(f"gen.{model}", held=4) as taken:
        # 4 of its own + two messages of 4 = 12 rows; the third would not fit
        assert taken.ids == ["0a", "0b", "0c", "0d", "1a", "1b", "1c", "1d"]
        assert len(taken.task_ids) == 2 and all(taken.task_ids)
        assert _unacked(app) == unacked + 2  # held, unacknowledged, while the batch runs
    assert _unacked(app) == unacked  # acknowledged after it
    assert _waiting(app, model) == [[f"{k}{x}" for x in "abcd"] for k in (2, 3, 4)]


def test_a_message_that_would_not_fit_stays_at_the_head_of_the_queue(app, model: str) -> None:  # noqa: ANN001
    _send(app, model, ["a"])
    _send(app, model, ["b", "c", "d"])
    _send(app, model, ["e"])
    with Coalescer(app, max_rows=3, max_wait_s=0).take(f"gen.{model}", held=1) as taken:
        assert taken.ids == ["a"]
    assert _waiting(app, model) == [["b", "c", "d"], ["e"]]  # its place kept, next in line


def test_a_batch_that_raises_puts_its_messages_back_in_order(app, model: str) -> None:  # noqa: ANN001
    unacked = _unacked(app)
    for k in range(3):
        _send(app, model, [f"{k}"])
    with pytest.raises(RuntimeError, match="engine broke"):
        with Coalescer(app, max_rows=64, max_wait_s=0).take(f"gen.{model}", held=1) as taken:
            assert taken.ids == ["0", "1", "2"]
            raise RuntimeError("engine broke")
    assert _waiting(app, model) == [["0"], ["1"], ["2"]]
    assert _unacked(app) == unacked


def test_another_task_at_the_head_stops_the_taking_and_stays(app, model: str) -> None:  # noqa: ANN001
    _send(app, model, ["a"])
    app.send_task("agentloop.sweep", args=[], queue=f"gen.{model}")
    _send(app, model, ["b"])
    with Coalescer(app, max_rows=64, max_wait_s=0).take(f"gen.{model}", held=1) as taken:
        assert taken.ids == ["a"]
    import redis

    assert redis.Redis.from_url(URL).llen(f"gen.{model}") == 2


def test_an_idle_queue_is_waited_on_for_at_most_the_wait(app, model: str) -> None:  # noqa: ANN001
    late = threading.Timer(0.15, _send, args=(app, model, ["late"]))
    late.start()
    t0 = time.monotonic()
    with Coalescer(app, max_rows=64, max_wait_s=0.6).take(f"gen.{model}", held=1) as taken:
        waited = time.monotonic() - t0
    late.join()
    assert taken.ids == ["late"]  # arrived during the wait
    assert 0.5 <= waited < 2.0, waited  # and the wait ran its course (the batch is not full)
    t0 = time.monotonic()
    with Coalescer(app, max_rows=2, max_wait_s=5).take(f"gen.{model}", held=2) as taken:
        assert taken.ids == []
    assert time.monotonic() - t0 < 1.0  # a full batch does not wait


def test_the_queue_comes_from_the_delivery_and_only_generation_queues_coalesce() -> None:
    assert queue_of({"routing_key": "gen.shapes", "exchange": ""}) == "gen.shapes"
    assert queue_of({"routing_key": "control"}) is None
    assert queue_of(None) is None and queue_of({}) is None


def test_the_settings_bound_the_batch_and_the_wait() -> None:
    from pydantic import ValidationError

    from agentloop.settings import Settings

    s = Settings()
    assert s.gen_coalesce and s.gen_max_batch == 64 and s.gen_max_wait_ms == 50.0
    with pytest.raises(ValidationError, match="gen_max_batch"):
        Settings(gen_max_batch=0)
    with pytest.raises(ValidationError, match="gen_max_wait_ms"):
        Settings(gen_max_wait_ms=-1)
    with pytest.raises(ValidationError, match="shorter than outbox_grace_seconds"):
        Settings(gen_max_wait_ms=5000, outbox_grace_seconds=5)
    assert Settings(gen_max_wait_ms=5000, gen_coalesce=False).gen_max_wait_ms == 5000
