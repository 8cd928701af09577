"""Goals with reviser `llm` in the orchestrator and the embedded runtime, against the scripted
chat-completions server of tests/core/llm_server.py (no language model can run here): the
model is asked outside the goal's lock, its notes land in the iteration, and a whole goal on
the shapes model runs to the end on its moves."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentloop.domain import GoalStatus, split_parts
from agentloop.orchestrator import Policy, advance, cancel_goal
from agentloop.revisers import objective
from agentloop.settings import Settings
from agentloop.store import Store
from tests.core.helpers import finish_all, make_goal
from tests.core.llm_server import Reply, ScriptedLLM, chat
from workers.embedded import embedded_runtime


def llm_settings(settings: Settings, server: ScriptedLLM, **kw: Any) -> Settings:
    return settings.model_copy(update={
        "llm_base_url": server.url, "llm_model": "scripted", "llm_backoff_seconds": 0.01, **kw})


def moves_for(body: dict[str, Any]) -> Reply:
    """A scripted model: fresh prompts first, then a refinement and a reseed of the best."""
    import json

    seen = json.loads(body["messages"][1]["content"])
    if not seen["best"]:
        moves = [{"kind": "prompt", "prompt": seen["goal"], "seed": "new"},
                 {"kind": "prompt", "prompt": f"{seen['goal']}, flat colours", "seed": "new"}]
    else:
        best = seen["best"][0]
        moves = [{"kind": "refine", "parent_id": best["id"], "prompt": f"{best['prompt']}, bold",
                  "why": "sharpen the best"},
                 {"kind": "prompt", "prompt": best["prompt"], "seed": "new"}]
    return chat({"rationale": f"iteration {seen['iteration']}", "moves": moves[: seen["n"]]},
                prompt_tokens=500 + seen["iteration"], completion_tokens=60)


def test_the_model_is_asked_outside_the_goals_lock_and_its_notes_are_kept(
    sqlite_url: str, settings: Settings,
) -> None:
    store = Store(sqlite_url)

    def slow(body: dict[str, Any]) -> Reply:
        reply = moves_for(body)
        reply.delay = 1.0
        return reply

    with ScriptedLLM(slow) as server:
        s = llm_settings(settings, server)
        goal_id = make_goal(store, s, goal="a red circle and a blue square", budget=4, fanout=2,
                            reviser="llm")
        other = make_goal(store, s, budget=2)
        writes: list[float] = []

        def write_meanwhile() -> None:
            time.sleep(0.3)  # while the model thinks
            started = time.monotonic()
            cancel_goal(store, other)  # a write transaction (SQLite: the database's write lock)
            writes.append(time.monotonic() - started)

        writer = threading.Thread(target=write_meanwhile)
        writer.start()
        decision = advance(store, goal_id, Policy.of(s))
        writer.join()
    assert writes and writes[0] < 0.5  # not blocked for the model's second
    assert decision is not None and len(decision.dispatch) == 2
    state = store.get_state(goal_id)
    notes = state.iterations[0].notes
    assert notes["strategy"] == "llm" and notes["llm"]["prompt_tokens"] == 500
    assert notes["llm"]["latency_s"] >= 1.0 and notes["rationale"] == "iteration 0"
    assert [c.prompt for c in state.candidates] == [
        "a red circle and a blue square", "a red circle and a blue square, flat colours"]
    store.dispose()


def test_a_goal_cancelled_while_the_model_thinks_gets_no_candidates(
    sqlite_url: str, settings: Settings,
) -> None:
    store = Store(sqlite_url)
    holder: dict[str, str] = {}

    def cancelling(body: dict[str, Any]) -> Reply:
        cancel_goal(store, holder["goal"])  # the goal ends between the snapshot and the step
        return moves_for(body)

    with ScriptedLLM(cancelling) as server:
        s = llm_settings(settings, server)
        holder["goal"] = make_goal(store, s, budget=4, fanout=2, reviser="llm")
        decision = advance(store, holder["goal"], Policy.of(s))
    assert decision is not None and decision.new_candidates == []
    assert store.list_candidates(holder["goal"]) == [] and len(server.requests) == 1
    store.dispose()


def test_a_failing_endpoint_falls_back_to_search_and_the_goal_goes_on(
    sqlite_url: str, settings: Settings,
) -> None:
    store = Store(sqlite_url)
    down = [Reply(503, {"error": {"message": "loading model"}}) for _ in range(4)]
    with ScriptedLLM(down) as server:
        s = llm_settings(settings, server, llm_max_attempts=2)
        goal_id = make_goal(store, s, budget=4, fanout=2, reviser="llm")
        first = advance(store, goal_id, Policy.of(s))
        finish_all(store, first.dispatch, lambda c: 0.5)
        second = advance(store, goal_id, Policy.of(s))
    assert len(first.dispatch) == len(second.dispatch) == 2
    for it in store.get_state(goal_id).iterations:
        assert it.notes["reviser"] == "llm" and it.notes["strategy"] in ("seeds", "search")
        assert it.notes["llm"]["fallback"].startswith("HTTP 503") and it.notes["llm"]["attempts"] == 2
    store.dispose()


@pytest.mark.slow
def test_a_goal_on_the_shapes_model_runs_to_the_end_on_the_models_moves(
    sqlite_url: str, tmp_path: Path,
) -> None:
    store = Store(sqlite_url)
    with ScriptedLLM(moves_for) as server:
        s = Settings(data_dir=tmp_path / "data", default_model="shapes",
                     default_scorer="shapes-clip", llm_base_url=server.url, llm_model="scripted")
        goal_id = make_goal(store, s, goal="a red circle and a blue square", budget=4, fanout=2,
                            max_iterations=2, steps=4, seed=3, reviser="llm")
        dispatcher, _ctx = embedded_runtime(store, s, sweep=False)
        try:
            dispatcher.advance_goal(goal_id)
            deadline = time.monotonic() + 240
            while not store.get_goal(goal_id).status.terminal:
                assert time.monotonic() < deadline and not dispatcher.errors, dispatcher.errors
                time.sleep(0.05)
        finally:
            dispatcher.close()
    state = store.get_state(goal_id)
    assert state.goal.status is GoalStatus.DONE and state.goal.stop_reason == "budget_spent"
    assert len(server.requests) == 2 and server.situation(0)["best"] == []
    assert [it.notes["strategy"] for it in state.iterations] == ["llm"] * 2
    assert [it.notes["llm"]["prompt_tokens"] for it in state.iterations] == [500, 501]
    cands = state.candidates
    assert len(cands) == 4 and all(c.clip_score is not None for c in cands)
    assert [c.prompt for c in cands[:2]] == [
        "a red circle and a blue square", "a red circle and a blue square, flat colours"]
    # the second iteration refines the best candidate the model was shown, keeping its seed
    shown_best = server.situation(1)["best"][0]
    parts = split_parts(state.goal.spec.goal)
    assert shown_best["id"] == max(cands[:2], key=lambda c: objective(c, parts)).id
    refine, reseed = cands[2:]
    assert (refine.parent_id, refine.seed, refine.edit) == (shown_best["id"], shown_best["seed"], "llm:refine")
    assert refine.prompt == shown_best["prompt"] + ", bold"
    assert reseed.prompt == shown_best["prompt"] and reseed.seed != shown_best["seed"]
    assert state.goal.best_candidate_id in {c.id for c in cands}
    store.dispose()


def test_the_cli_says_what_is_missing_for_reviser_llm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from agentloop.cli import app
    from agentloop.settings import get_settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGENTLOOP_DATA_DIR", str(tmp_path / "data"))
    for var in ("AGENTLOOP_DATABASE_URL", "AGENTLOOP_BROKER_URL", "AGENTLOOP_LLM_MODEL",
                "AGENTLOOP_LLM_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["run", "a red circle", "--reviser", "llm"])
        assert result.exit_code == 2 and "invalid reviser" in result.output
        assert "AGENTLOOP_LLM_BASE_URL" in result.output and not (tmp_path / "data").exists()
        monkeypatch.setenv("AGENTLOOP_LLM_BASE_URL", "http://127.0.0.1:8000/v1")
        get_settings.cache_clear()
        result = CliRunner().invoke(app, ["run", "a red circle", "--reviser", "llm"])
        assert result.exit_code == 1 and "invalid settings" in result.output
        assert "AGENTLOOP_LLM_MODEL" in " ".join(result.output.split())
    finally:
        get_settings.cache_clear()


def test_two_steps_of_one_goal_at_once_ask_the_model_once(sqlite_url: str, settings: Settings) -> None:
    """The sweep may advance a goal while its model still thinks: in one process the second
    step waits for the first one's answer; one iteration is opened."""
    store = Store(sqlite_url)

    def slow(body: dict[str, Any]) -> Reply:
        reply = moves_for(body)
        reply.delay = 0.5
        return reply

    with ScriptedLLM(slow) as server:
        s = llm_settings(settings, server)
        goal_id = make_goal(store, s, budget=4, fanout=2, reviser="llm")
        decisions: list[Any] = []
        steps = [threading.Thread(target=lambda: decisions.append(advance(store, goal_id, Policy.of(s))))
                 for _ in range(2)]
        for t in steps:
            t.start()
        for t in steps:
            t.join()
    assert len(server.requests) == 1
    assert sorted(len(d.dispatch) for d in decisions) == [0, 2]
    assert len(store.get_state(goal_id).iterations) == 1 and len(store.list_candidates(goal_id)) == 2
    store.dispose()
