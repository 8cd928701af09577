"""Every accepted goal finishes: real faults injected into a real cluster (see `cluster.py`).

Each test kills or breaks one thing while goals are in flight — the generation worker (killed,
or frozen until its claims expire), the control worker, the API between its commit and its
send, Redis (its data lost), PostgreSQL — or delivers the same messages twice, or cancels
under load; then it waits for every goal to end and checks the invariants
(`Cluster.check_invariants`). Recovery rests on the claim lease, the reconciler sweep sent
by beat and the outbox (settings shortened in `cluster.FAST_SETTINGS`, so recovery takes
seconds).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.cluster import Cluster, PostgresServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# tiny-dit, one torch thread, a batch of four on this 2-core machine under load: LONG about
# 4 s (a kill lands mid-batch), MEDIUM about 1 s (goals in flight long enough to hit). A fresh
# generation worker's first batch also imports the engine: 15-30 s here.
LONG = {"steps": 200, "size": 128}
MEDIUM = {"steps": 100, "size": 64}


def _running(cluster: Cluster, goal_id: str | None = None) -> list[dict]:
    return [c for c in cluster.candidate_rows(goal_id) if c["status"] == "running"]


def _succeeded(cluster: Cluster) -> int:
    return sum(c["status"] == "succeeded" for c in cluster.candidate_rows())


def _received(log: Path) -> int:
    """How many task messages a worker has taken, by its log."""
    return log.read_text(errors="replace").count("] received")


def _finished(log: Path) -> int:
    """How many tasks a worker has finished (succeeded or raised), by its log."""
    text = log.read_text(errors="replace")
    return text.count("] succeeded in") + text.count("] raised unexpected")


@pytest.mark.timeout(180)
def test_killed_generation_worker_its_candidates_are_claimed_again(cluster: Cluster) -> None:
    _kill_the_generation_worker_mid_batch(cluster, bound=60)


@pytest.mark.timeout(240)
def test_killed_generation_worker_with_the_shipped_settings_costs_under_a_minute(
    default_cluster: Cluster,
) -> None:
    """docs/reliability.md promises lease + sweep (30 + 10 s) at the defaults; the target is
    60 s from the kill to the candidates' next claim."""
    seconds = _kill_the_generation_worker_mid_batch(default_cluster, bound=60)
    assert seconds > 15, "taken back before the lease could have expired: what else did it?"


def _kill_the_generation_worker_mid_batch(cluster: Cluster, bound: float) -> float:
    """SIGKILL the generation worker while its candidates run, start a fresh one at once;
    the killed candidates are claimed again within `bound` seconds of the kill (returned),
    by the new worker, and the goal completes."""
    goal_id = cluster.create_goal(budget=4, fanout=4, **LONG)
    running = wait_for(lambda: _running(cluster, goal_id), 60, "a running candidate")
    gen1 = cluster.current("gen")

    # The threads pool keeps the consumer reachable while the batch runs.
    replies = cluster.celery().control.ping(destination=[gen1.celery_name], timeout=2)
    assert any(gen1.celery_name in reply for reply in replies), replies
    assert {c["id"] for c in _running(cluster, goal_id)} >= {c["id"] for c in running}, (
        "the batch ended before the ping was answered; make LONG longer"
    )

    killed = {c["id"]: c["worker"] for c in running}
    cluster.kill(gen1.name)
    killed_at = time.monotonic()
    cluster.start("gen", wait=False)

    def reclaimed() -> dict[str, dict] | None:
        rows = {c["id"]: c for c in cluster.candidate_rows(goal_id)}
        return rows if all(rows[cid]["attempts"] >= 2 for cid in killed) else None

    try:
        rows = wait_for(reclaimed, bound, "the killed candidates to be claimed again")
    finally:
        print(f"candidates after the kill: {cluster.candidate_summary([goal_id])}")
    seconds = time.monotonic() - killed_at
    print(f"killed candidates claimed again {seconds:.1f}s after the kill")
    for cid, old_worker in killed.items():
        assert rows[cid]["attempts"] == 2, rows[cid]
        assert rows[cid]["worker"] != old_worker, rows[cid]
    assert cluster.wait_goals_ended([goal_id], 60)[goal_id] == "done"
    uris = {c["id"]: c["artifact_uri"] for c in cluster.candidate_rows(goal_id)}
    for cid in killed:  # one file per claim: the second attempt's
        assert uris[cid] == f"{goal_id}/{cid}-2.png", uris[cid]
    cluster.check_invariants()
    return seconds


@pytest.mark.timeout(180)
def test_frozen_generation_worker_loses_its_claim_and_leaves_no_file(cluster: Cluster) -> None:
    goal_id = cluster.create_goal(budget=4, fanout=4, **LONG)
    running = wait_for(lambda: _running(cluster, goal_id), 60, "a running candidate")
    gen1 = cluster.freeze("gen")  # no progress, no lease renewal: its claims expire
    cluster.start("gen", wait=False)
    assert cluster.wait_goals_ended([goal_id], 75)[goal_id] == "done"
    cluster.thaw(gen1.name)  # it finishes its batch on claims it no longer holds
    wait_for(lambda: _finished(gen1.log) >= 1, 60, "the thawed worker to finish its batch")
    first_worker = running[0]["worker"]
    for c in cluster.candidate_rows(goal_id):
        assert c["attempts"] == 2 and c["worker"] != first_worker, c
    cluster.check_invariants()  # the loser deleted its files; the winner's are intact


@pytest.mark.timeout(180)
def test_killed_control_worker_every_goal_completes(cluster: Cluster) -> None:
    goal_ids = [cluster.create_goal(budget=8, fanout=4, seed=i, **MEDIUM) for i in range(6)]
    # Twice: freeze the control worker's pool so the next advance_goal it takes stays in
    # hand, mid-step, then SIGKILL it and start a new one.
    for threshold in (4, 20):
        wait_for(lambda n=threshold: _succeeded(cluster) >= n, 90, f"{threshold} successes")
        control = cluster.current("control")
        cluster.freeze_pool(control.name)
        # a message taken and not finished: either one it took after the freeze, or one it
        # had already taken (batches now finish many goals at once, so the worker may hold
        # its prefetch's worth of advance_goal messages the moment its pool stops)
        wait_for(lambda log=control.log: _received(log) > _finished(log), 30,
                 "a message in the frozen worker's hands")
        cluster.restart("control", wait=False)
    statuses = cluster.wait_goals_ended(goal_ids, 60)
    assert set(statuses.values()) == {"done"}, statuses
    cluster.check_invariants()


@pytest.mark.timeout(180)
def test_api_killed_between_commit_and_send_the_goal_still_completes(cluster: Cluster) -> None:
    cluster.redis.pause(8000)  # every client's next command hangs for 8 s
    paused_until = time.monotonic() + 8
    try:
        cluster.create_goal(timeout=2, budget=4, fanout=4, **MEDIUM)
        print("the API answered while Redis was paused: it sends after answering")
    except httpx.TimeoutException:
        pass  # stuck in its send, as expected of a send before the answer
    goals = cluster.rows("SELECT id, status FROM goals")
    assert [g["status"] for g in goals] == ["pending"], goals  # committed; stuck in its send
    cluster.kill("api")
    time.sleep(max(0.0, paused_until - time.monotonic()) + 0.5)
    cluster.start("api")
    goal_id = goals[0]["id"]
    assert cluster.wait_goals_ended([goal_id], 60)[goal_id] == "done"
    cluster.check_invariants()


@pytest.mark.timeout(180)
def test_redis_flushed_and_restarted_empty_every_goal_completes(cluster: Cluster) -> None:
    goal_ids = [cluster.create_goal(budget=8, fanout=4, seed=i, **MEDIUM) for i in range(4)]
    wait_for(lambda: _running(cluster), 60, "a running candidate")
    cluster.redis.flushall()  # queued messages, unacked messages and bindings: gone
    wait_for(lambda: _running(cluster), 60, "a running candidate after the flush")
    cluster.redis.restart()  # kill -9, same port, empty
    goal_ids.append(cluster.create_goal(budget=4, fanout=4, **MEDIUM))  # the API reconnects
    statuses = cluster.wait_goals_ended(goal_ids, 75)
    assert set(statuses.values()) == {"done"}, statuses
    cluster.check_invariants()


@pytest.mark.timeout(240)
def test_postgres_restarted_every_goal_completes_and_the_api_answers_503(
    pg_cluster: Cluster, postgres_server: PostgresServer
) -> None:
    cluster = pg_cluster
    goal_ids = [cluster.create_goal(budget=8, fanout=4, seed=i, **MEDIUM) for i in range(3)]
    # Once the worker is warm (batches of about a second), so that a batch ends, and its
    # results must be written, while the database is down.
    wait_for(lambda: _succeeded(cluster) >= 4 and _running(cluster), 90, "a warm worker")
    postgres_server.crash()
    down_at = time.monotonic()
    bound = 2 * int(cluster.env["AGENTLOOP_DB_CONNECT_TIMEOUT"]) + 1
    problems: list[str] = []
    for path in ("/healthz", f"/v1/goals/{goal_ids[0]}"):
        t0 = time.monotonic()
        try:
            r = cluster.http.get(path, timeout=bound + 10)
            outcome = f"{r.status_code} in {time.monotonic() - t0:.1f}s"
            ok = r.status_code == 503 and time.monotonic() - t0 <= bound
        except httpx.TimeoutException:
            outcome, ok = f"no answer in {bound + 10}s", False
        print(f"database down: GET {path} -> {outcome}")
        if not ok:
            problems.append(f"GET {path} with the database down: {outcome}, want 503 within {bound}s")
    time.sleep(max(0.0, down_at + 5 - time.monotonic()))  # a few seconds down
    postgres_server.start()
    try:
        statuses = cluster.wait_goals_ended(goal_ids, 60)
        if set(statuses.values()) != {"done"}:
            problems.append(f"goals after the restart: {statuses}")
    except AssertionError as exc:
        problems.append(str(exc))
    assert not problems, "\n".join(problems)
    assert cluster.http.get("/healthz").status_code == 200
    cluster.check_invariants()


@pytest.mark.timeout(180)
def test_duplicate_and_concurrent_messages_change_nothing(cluster: Cluster) -> None:
    cluster.start("gen")  # two generation workers on the same queue
    goal_id = cluster.create_goal(budget=4, fanout=4, reviser="external", **LONG)
    prompts = [{"prompt": "a red circle", "seed": seed} for seed in range(4)]
    r = cluster.http.post(f"/v1/goals/{goal_id}/iterations", json={"prompts": prompts})
    assert r.status_code == 201, r.text
    ids = r.json()["candidate_ids"]

    def deliver(task: str, args: list, queue: str) -> None:
        cluster.celery().send_task(task, args=args, queue=queue)

    sends = [("agentloop.generate", [ids], "gen.tiny-dit")] * 2 + [
        ("agentloop.advance_goal", [goal_id], "control")
    ] * 3
    threads = [threading.Thread(target=deliver, args=send) for send in sends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert cluster.wait_goals_ended([goal_id], 90)[goal_id] == "done"
    goal = cluster.goal(goal_id)
    assert goal["generations_reserved"] == 4 and goal["generations_done"] == 4, goal
    assert len(goal["iterations"]) == 1, goal["iterations"]
    rows = cluster.candidate_rows(goal_id)
    assert sorted(c["id"] for c in rows) == sorted(ids)
    assert [c["attempts"] for c in rows] == [1] * 4, [(c["status"], c["attempts"]) for c in rows]
    assert {c["status"] for c in rows} == {"succeeded"}
    cluster.check_invariants()


@pytest.mark.timeout(180)
def test_cancel_under_load_stops_cancelled_goals_and_spares_the_rest(cluster: Cluster) -> None:
    goal_ids = [cluster.create_goal(budget=8, fanout=4, seed=i, **MEDIUM) for i in range(8)]
    wait_for(lambda: _running(cluster), 60, "a running candidate")
    cancelled, others = goal_ids[:4], goal_ids[4:]
    for goal_id in cancelled:
        r = cluster.http.post(f"/v1/goals/{goal_id}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    r = cluster.http.post(f"/v1/goals/{cancelled[0]}/cancel")  # idempotent
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert cluster.http.post("/v1/goals/0123456789abcdef/cancel").status_code == 404

    statuses = cluster.wait_goals_ended(goal_ids, 75)
    assert [statuses[g] for g in cancelled] == ["cancelled"] * 4, statuses
    assert [statuses[g] for g in others] == ["done"] * 4, statuses
    assert cluster.http.post(f"/v1/goals/{others[0]}/cancel").status_code == 409
    cluster.check_invariants()  # also waits for a cancelled goal's running batch to settle

    goals = {g["id"]: g for g in cluster.rows("SELECT id, finished_at FROM goals")}
    for goal_id in cancelled:
        cancelled_at = goals[goal_id]["finished_at"]
        assert cancelled_at is not None
        for c in cluster.candidate_rows(goal_id):
            late = c["started_at"] is not None and c["started_at"] > cancelled_at
            assert not late, f"candidate {c['id']} started {c['started_at']} after {cancelled_at}"
            if c["started_at"] is None:  # queued when the goal was cancelled
                assert c["status"] == "cancelled", c
