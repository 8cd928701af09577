"""A generation worker batches across goals: real processes (`cluster.py`: API, control worker,
one generation worker on `--pool threads -c 1`, beat), a Redis of the test's own and a fresh
PostgreSQL database. Goals submitted together are generated in fewer engine batches than
generation messages; every candidate is recorded once; a poisoned candidate in a batch across
goals fails alone; a worker killed in the middle of such a batch still lets every goal finish.

`AGENTLOOP_GEN_MAX_WAIT_MS` is raised to 2 s so that the first task waits for the goals posted
after it (in production the messages pile up while the GPU is busy; here the engine is quick),
and the outbox grace to 5 s, the shipped value (the wait must stay under it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster, RedisServer, wait_for
from tests.integration.conftest import make_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WAIT = {"AGENTLOOP_GEN_MAX_WAIT_MS": "2000", "AGENTLOOP_OUTBOX_GRACE_SECONDS": "5"}


@pytest.fixture
def noop_cluster(pg_empty_url: str, redis_server: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    """The no-op engine, with a generation worker whose engine breaks on "poison"."""
    yield from make_cluster(pg_empty_url, redis_server, tmp_path,
                            {**WAIT, "AGENTLOOP_ENGINE_NOOP": "1"},
                            gen_app="tests.integration.poisoned_app")


@pytest.fixture
def tiny_cluster(pg_empty_url: str, redis_server: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    """The real tiny-dit engine (batches long enough to be killed in)."""
    yield from make_cluster(pg_empty_url, redis_server, tmp_path, WAIT)


def _submit(cluster: Cluster, prompts: list[list[str]]) -> list[str]:
    """One external goal per prompt list, each sent as one iteration (one generation message),
    back to back. Returns the goal ids."""
    goal_ids = [cluster.create_goal(reviser="external", budget=len(p), fanout=len(p))
                for p in prompts]
    for goal_id, texts in zip(goal_ids, prompts, strict=True):
        body = {"prompts": [{"prompt": t, "seed": k} for k, t in enumerate(texts)]}
        r = cluster.http.post(f"/v1/goals/{goal_id}/iterations", json=body)
        assert r.status_code == 201, r.text
    return goal_ids


def _engine_calls(rows: list[dict]) -> dict[tuple[str, float], list[dict]]:
    """Succeeded candidates by the engine call that made them: the worker and the batch's
    wall time, which every candidate of one call records."""
    calls: dict[tuple[str, float], list[dict]] = {}
    for c in rows:
        if c["status"] == "succeeded":
            calls.setdefault((c["worker"], c["timings"]["generate_batch_s"]), []).append(c)
    return calls


class EventLog:
    """Celery task events on the cluster's broker (what Flower reads), from now on."""

    def __init__(self, cluster: Cluster) -> None:
        self.events: list[dict] = []
        self.app = cluster.celery()
        self.conn = self.app.connection()
        self.receiver = self.app.events.Receiver(self.conn, handlers={"*": self.events.append})
        ready, bind = threading.Event(), self.receiver.on_consume_ready

        def bound(*args, **kwargs) -> None:  # noqa: ANN002,ANN003
            bind(*args, **kwargs)
            ready.set()  # its queue is bound: every event from now on reaches it

        self.receiver.on_consume_ready = bound
        self.thread = threading.Thread(
            target=self.receiver.capture, kwargs={"wakeup": False}, daemon=True)
        self.thread.start()
        assert ready.wait(10), "the event receiver did not start"

    def of(self, kind: str) -> list[dict]:
        return [e for e in list(self.events) if e.get("type") == kind]

    def close(self) -> None:
        self.receiver.should_stop = True
        self.thread.join(5)
        self.conn.release()


@pytest.mark.timeout(150)
def test_goals_submitted_together_share_batches_and_a_poisoned_candidate_fails_alone(
    noop_cluster: Cluster,
) -> None:
    cluster = noop_cluster
    gen = cluster.current("gen")
    colours = ("red", "blue", "green", "gold")

    # four goals, four messages of four candidates: fewer engine batches than messages
    events = EventLog(cluster)
    goals = _submit(cluster, [[f"a {c} circle number {k}" for k in range(4)] for c in colours])
    assert set(cluster.wait_goals_ended(goals, 60).values()) == {"done"}
    # every generation message is reported done to monitors, those taken into a batch too
    sent = {e["uuid"] for e in events.of("task-sent") if e.get("name") == "agentloop.generate"}
    assert len(sent) >= 4, events.of("task-sent")
    wait_for(lambda: sent <= {e["uuid"] for e in events.of("task-succeeded")}, 10,
             "a task-succeeded event for every generation message")
    events.close()
    rows = [c for g in goals for c in cluster.candidate_rows(g)]
    assert len(rows) == 16 and {(c["status"], c["attempts"]) for c in rows} == {("succeeded", 1)}
    calls = _engine_calls(rows)
    print(f"16 candidates of 4 messages in {len(calls)} engine call(s): "
          f"{sorted(len(v) for v in calls.values())}")
    assert len(calls) < 4
    biggest = max(calls.values(), key=len)
    assert len({c["goal_id"] for c in biggest}) >= 2  # one call held several goals' candidates
    assert {c["timings"]["batch_size"] for c in biggest} == {float(len(biggest))}
    assert "coalesced" in gen.log.read_text(errors="replace")
    cluster.check_invariants()  # recorded once: one image per candidate, no stray file

    # a poisoned candidate among three goals: it breaks its batch once; every member is
    # retried in a batch of its own, so it fails alone and its neighbours succeed
    prompts = [[f"a {c} square number {k}" for k in range(4)] for c in colours[:3]]
    prompts[0][1] = "a poison square"
    goals = _submit(cluster, prompts)
    cluster.wait_goals_ended(goals, 60)
    rows = [c for g in goals for c in cluster.candidate_rows(g)]
    poisoned = [c for c in rows if c["prompt"] == "a poison square"]
    assert len(poisoned) == 1 and poisoned[0]["status"] == "failed", poisoned
    assert poisoned[0]["attempts"] == 3 and "NaN in the latents" in poisoned[0]["error"]
    others = [c for c in rows if c["prompt"] != "a poison square"]
    assert len(others) == 11 and {c["status"] for c in others} == {"succeeded"}, others
    # its batch held other goals' candidates: they lost one attempt to it, and only one
    hit = [c for c in others if c["attempts"] == 2]
    assert {c["goal_id"] for c in hit} - {poisoned[0]["goal_id"]}, (
        "the poisoned candidate shared no batch with another goal")
    assert all(c["attempts"] <= 2 for c in others)
    assert all(c["timings"]["batch_size"] == 1.0 for c in hit)  # each retry ran alone
    cluster.check_invariants()


def _running_goals(cluster: Cluster) -> set[str]:
    return {c["goal_id"] for c in cluster.candidate_rows() if c["status"] == "running"}


@pytest.mark.timeout(240)
def test_a_worker_killed_in_a_batch_across_goals_every_goal_finishes(
    tiny_cluster: Cluster,
) -> None:
    cluster = tiny_cluster
    goals = [cluster.create_goal(goal=f"a red circle number {i}", budget=4, fanout=4, seed=i,
                                 steps=50, size=64) for i in range(4)]
    # the worker's first batch (which also loads the model) holds several goals' candidates
    wait_for(lambda: len(_running_goals(cluster)) >= 2, 60, "a batch across goals running")
    running = [c for c in cluster.candidate_rows() if c["status"] == "running"]
    gen1 = cluster.kill("gen")
    cluster.start("gen", wait=False)
    killed = {c["id"] for c in running if c["worker"] == gen1.worker_label}
    assert len({c["goal_id"] for c in running if c["id"] in killed}) >= 2, running
    t0 = time.monotonic()
    statuses = cluster.wait_goals_ended(goals, 150)
    print(f"every goal ended {time.monotonic() - t0:.1f}s after the kill")
    assert set(statuses.values()) == {"done"}, statuses
    rows = {c["id"]: c for c in cluster.candidate_rows()}
    for cid in killed:  # claimed again by the new worker, each in a batch of its own
        assert rows[cid]["status"] == "succeeded" and rows[cid]["attempts"] == 2, rows[cid]
        assert rows[cid]["worker"] != gen1.worker_label
        assert rows[cid]["timings"]["batch_size"] == 1.0
    cluster.check_invariants()
