"""The `llm` reviser against a scripted chat-completions server (tests/core/llm_server.py: no
language model can run here, so a real HTTP server answers from a script): valid answers
become drafts, every failure an endpoint can show is retried per the settings and then falls
back to `search`, and the notes record model, latency, tokens, attempts and why."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import pytest

from agentloop.domain import (
    CandidateStatus,
    CandidateView,
    GoalInvalid,
    GoalRequest,
    check_goal,
    split_parts,
)
from agentloop.llm import LlmConfig
from agentloop.revisers import LlmReviser, ReviserContext, SearchReviser, derive_seed, get_reviser
from agentloop.revisers.llm import ANSWER_SCHEMA, SEED_SALT
from agentloop.settings import Settings
from tests.core.llm_server import Reply, ScriptedLLM, chat

SETTINGS = Settings(default_model="tiny-dit", default_scorer="tiny-clip")
GOAL = "a red circle on the left and a blue square on the right"


def spec(goal: str = GOAL, **kw: Any):  # noqa: ANN201
    return check_goal(GoalRequest(goal=goal, **kw), SETTINGS)


def cand(i: int, prompt: str, seed: int, score: float, parts: dict[str, float] | None = None,
         params: dict[str, Any] | None = None) -> CandidateView:
    return CandidateView(
        id=f"c{i}", goal_id="g", iteration=0, ordinal=i, prompt=prompt, negative_prompt="",
        seed=seed, params=params or {}, status=CandidateStatus.SUCCEEDED, attempts=1, worker="w",
        clip_score=score, part_scores=parts or {}, artifact_uri=None, timings={}, error=None,
        parent_id=None, edit=None, queued_at=None, started_at=None, finished_at=None,
    )


def history() -> list[CandidateView]:
    p = split_parts(GOAL)
    return [cand(0, GOAL, 11, 0.9, {p[0]: 0.8, p[1]: 0.3}),
            cand(1, GOAL, 22, 0.5, {p[0]: 0.4, p[1]: 0.4}),
            cand(2, GOAL, 33, 0.2, {p[0]: 0.1, p[1]: 0.1})]


def ctx(s=None, hist=None, n: int = 3, iteration: int = 1) -> ReviserContext:  # noqa: ANN001
    s = s or spec()
    return ReviserContext(s, split_parts(s.goal), iteration, n, history() if hist is None else hist)


def reviser(server: ScriptedLLM, **kw: Any) -> LlmReviser:
    cfg = {"timeout_seconds": 5.0, "max_attempts": 3, "backoff_seconds": 0.01} | kw
    return LlmReviser(LlmConfig(server.url, "scripted-model", api_key="sk-test", **cfg))


GOOD = {"rationale": "the square is weak", "moves": [
    {"kind": "refine", "parent_id": "c0", "prompt": "a red circle on the left and a big blue "
     "square on the right", "why": "the square part scores 0.3"},
    {"kind": "prompt", "prompt": "a blue square on the right, a red circle on the left",
     "seed": "new"},
    {"kind": "layout", "regions": [{"prompt": "a red circle", "x": 0.25, "y": 0.5},
                                   {"prompt": "a blue square", "x": 0.75, "y": 0.5}],
     "seed": 7},
]}


def test_a_good_answer_becomes_the_drafts_and_the_notes_record_the_call() -> None:
    with ScriptedLLM([chat(GOOD, prompt_tokens=812, completion_tokens=133)]) as server:
        p = reviser(server).propose(ctx())
    refine, prompt, layout = p.candidates
    assert (refine.parent_id, refine.seed, refine.edit) == ("c0", 11, "llm:refine")  # keeps the noise
    assert "big blue square" in refine.prompt
    assert prompt.seed == derive_seed(0, 1, 1, SEED_SALT) and prompt.parent_id is None
    assert layout.seed == 7 and layout.regions == (("a red circle", 0.25, 0.5), ("a blue square", 0.75, 0.5))
    llm = p.notes["llm"]
    assert p.notes["strategy"] == "llm" and p.notes["rationale"] == "the square is weak"
    assert (llm["model"], llm["attempts"], llm["fallback"]) == ("scripted-model", 1, None)
    assert llm["served_model"] == "scripted"  # what the server's answer names
    assert (llm["prompt_tokens"], llm["completion_tokens"]) == (812, 133)
    assert 0 < llm["latency_s"] < 5 and llm["response_format"] == "json_schema"
    assert [m["why"] for m in p.notes["moves"]][0] == "the square part scores 0.3"
    sent = server.requests[0]
    assert server.headers[0]["authorization"] == "Bearer sk-test"
    assert sent["model"] == "scripted-model" and sent["temperature"] == 0.0
    assert sent["response_format"]["json_schema"]["schema"] == ANSWER_SCHEMA
    seen = server.situation()
    assert seen["goal"] == GOAL and seen["parts"] == list(split_parts(GOAL)) and seen["n"] == 3
    assert [c["id"] for c in seen["best"]] == ["c0", "c1", "c2"]
    assert seen["best"][0]["part_scores"] == {"a red circle on the left": 0.8,
                                             "a blue square on the right": 0.3}


def test_same_answers_give_the_same_drafts() -> None:
    def run() -> list[tuple[Any, ...]]:
        with ScriptedLLM([chat(GOOD)]) as server:
            p = reviser(server).propose(ctx())
        return [(d.prompt, d.seed, d.parent_id, d.edit, d.regions, d.variation_seed) for d in p.candidates]

    assert run() == run()


def test_malformed_json_is_asked_again_with_what_was_wrong() -> None:
    with ScriptedLLM([chat('{"moves": [ {"kind": "prompt", '), chat(GOOD)]) as server:
        p = reviser(server).propose(ctx())
    assert p.notes["strategy"] == "llm" and p.notes["llm"]["attempts"] == 2
    assert p.notes["llm"]["prompt_tokens"] == 200  # both attempts counted
    assert "not JSON" in p.notes["llm"]["errors"][0]
    retry = server.requests[1]["messages"]
    assert retry[2]["role"] == "assistant" and retry[3]["role"] == "user"
    assert "not valid JSON" in retry[3]["content"]


def test_an_answer_in_a_code_fence_is_read() -> None:
    with ScriptedLLM([chat("```json\n" + json.dumps(GOOD) + "\n```")]) as server:
        p = reviser(server).propose(ctx())
    assert p.notes["strategy"] == "llm" and len(p.candidates) == 3


@pytest.mark.parametrize(("bad", "problem"), [
    ({"moves": [{"kind": "layout", "regions": [{"prompt": "a", "x": 1.5, "y": 0.5}]}]}, "less than or equal to 1"),
    ({"moves": [{"kind": "prompt", "prompt": "x" * 2001}]}, "at most 2000"),
    ({"moves": [{"kind": "prompt"}]}, "needs a prompt"),
    ({"moves": [{"kind": "prompt", "prompt": "   "}]}, "only white space"),
    ({"moves": [{"kind": "layout", "regions": [{"prompt": "a\u0000b", "x": 0.5, "y": 0.5}]}]}, "NUL"),
    ({"moves": [{"kind": "prompt", "prompt": "a", "regions": [{"prompt": "b", "x": 0, "y": 0}]}]},
     "regions belong"),
    ({"moves": [{"kind": "paint", "prompt": "a"}]}, "kind"),
    ({"moves": [{"kind": "prompt", "prompt": "a", "colour": "red"}]}, "Extra inputs"),
    ({"moves": [{"kind": "prompt", "prompt": "a", "seed": "7"}]}, "seed"),
    ({"moves": []}, "at least 1"),
    ({"moves": [{"kind": "refine", "parent_id": "c404", "prompt": "a"}]}, "c404"),
    ({"moves": [{"kind": "refine", "parent_id": "c0"}]}, "must change something"),
    ({"moves": [{"kind": "repair", "parent_id": "c0", "prompt": "a",
                 "area": {"x": 0.8, "y": 0, "w": 0.5, "h": 0.5}}]}, "inside the image"),
])
def test_an_answer_that_breaks_the_rules_falls_back_to_search(bad: dict[str, Any], problem: str) -> None:
    with ScriptedLLM([chat(bad), chat(bad)]) as server:
        p = reviser(server, max_attempts=2).propose(ctx())
    expected = SearchReviser().propose(ctx())
    assert p.notes["strategy"] == "search" and p.notes["reviser"] == "llm"
    assert [(d.prompt, d.seed) for d in p.candidates] == [(d.prompt, d.seed) for d in expected.candidates]
    llm = p.notes["llm"]
    assert llm["attempts"] == 2 and "schema" in llm["fallback"] and problem in llm["fallback"]
    assert problem in server.requests[1]["messages"][3]["content"]  # the model was told


def test_an_unknown_candidate_id_is_corrected_on_the_next_attempt() -> None:
    wrong = {"moves": [{"kind": "refine", "parent_id": "c9", "prompt": "a red circle"}]}
    with ScriptedLLM([chat(wrong), chat(GOOD)]) as server:
        p = reviser(server).propose(ctx())
    assert p.notes["strategy"] == "llm" and p.notes["llm"]["attempts"] == 2
    assert "'c9' is not the id of a scored candidate" in server.requests[1]["messages"][3]["content"]


def test_a_slow_answer_times_out_and_falls_back() -> None:
    with ScriptedLLM([Reply(delay=2.0, body={}), Reply(delay=2.0, body={})]) as server:
        started = time.monotonic()
        p = reviser(server, timeout_seconds=0.3, max_attempts=2).propose(ctx())
        took = time.monotonic() - started
    assert p.notes["strategy"] == "search" and p.notes["llm"]["fallback"] == "timed out after 0.3 s"
    assert p.notes["llm"]["attempts"] == 2 and 0.6 <= p.notes["llm"]["latency_s"] < 1.8 and took < 1.8
    assert len(p.candidates) == 3


def test_a_server_error_is_retried_and_the_next_answer_used() -> None:
    with ScriptedLLM([Reply(500, {"error": {"message": "CUDA out of memory"}}), chat(GOOD)]) as server:
        p = reviser(server).propose(ctx())
    assert p.notes["strategy"] == "llm" and p.notes["llm"]["attempts"] == 2
    assert p.notes["llm"]["errors"] == ["HTTP 500: {\"error\": {\"message\": \"CUDA out of memory\"}}"]
    assert len(server.requests) == 2


def test_429_waits_its_retry_after_and_a_long_one_falls_back_at_once() -> None:
    limited = Reply(429, {"error": {"message": "rate limited"}}, {"Retry-After": "1"})
    with ScriptedLLM([limited, chat(GOOD)]) as server:
        started = time.monotonic()
        p = reviser(server).propose(ctx())
        waited = time.monotonic() - started
    assert p.notes["strategy"] == "llm" and p.notes["llm"]["attempts"] == 2 and waited >= 1.0
    too_long = Reply(429, {"error": {"message": "rate limited"}}, {"Retry-After": "120"})
    with ScriptedLLM([too_long, chat(GOOD)]) as server:
        p = reviser(server, max_wait_seconds=5).propose(ctx())
    assert p.notes["strategy"] == "search" and len(server.requests) == 1
    assert "Retry-After 120 s is longer than the 5 s allowed" in p.notes["llm"]["fallback"]


def test_a_refusal_or_a_bad_key_falls_back_without_retrying() -> None:
    with ScriptedLLM([chat(None, refusal="I can't help with that."), chat(GOOD)]) as server:
        p = reviser(server).propose(ctx())
    assert p.notes["llm"]["fallback"] == "refused: I can't help with that." and len(server.requests) == 1
    with ScriptedLLM([Reply(401, {"error": {"message": "invalid api key"}})]) as server:
        p = reviser(server).propose(ctx())
    assert p.notes["llm"]["fallback"].startswith("HTTP 401") and p.notes["strategy"] == "search"


def test_a_server_without_json_schema_is_asked_for_json_object_then() -> None:
    no_schema = Reply(400, {"error": {"message": "response_format json_schema is not supported"}})
    with ScriptedLLM([no_schema, chat(GOOD), chat(GOOD)]) as server:
        r = reviser(server)
        first = r.propose(ctx())
        second = r.propose(ctx())
    assert first.notes["strategy"] == second.notes["strategy"] == "llm"
    assert [q.get("response_format", {}).get("type") for q in server.requests] == [
        "json_schema", "json_object", "json_object"]  # remembered for the next iterations
    assert second.notes["llm"]["attempts"] == 1


def test_moves_the_engine_cannot_draw_are_mapped_and_the_rest_filled_by_search() -> None:
    s = spec(model="tiny-unet")  # a model that draws no layouts
    laid_out = cand(3, GOAL, 44, 0.95, params={"regions": [["a red circle", 0.25, 0.5],
                                                           ["a blue square", 0.75, 0.5]]})
    answer = {"moves": [
        {"kind": "repair", "parent_id": "c0", "prompt": "a red circle and a bright blue square",
         "area": {"x": 0.5, "y": 0.25, "w": 0.5, "h": 0.5}, "strength": 0.6},
        {"kind": "layout", "regions": [{"prompt": "a red circle", "x": 0.25, "y": 0.5},
                                       {"prompt": "a blue square", "x": 0.75, "y": 0.5}]},
        {"kind": "refine", "parent_id": "c1", "seed": "parent", "prompt": GOAL},  # repeats c1
    ]}
    with ScriptedLLM([chat(answer)]) as server:
        p = reviser(server).propose(ctx(s, n=5))
    repair, layout, repeat, *filled = p.candidates
    assert (repair.parent_id, repair.seed, repair.edit) == ("c0", 11, "llm:refine<-repair")
    assert repair.prompt == "a red circle and a bright blue square" and not repair.regions
    assert layout.prompt == "a red circle and a blue square" and layout.regions == ()
    assert repeat.parent_id == "c1" and repeat.seed != 22  # the same image again: a new seed
    assert len(filled) == 2 and p.notes["filled_by_search"] == 2
    assert len(p.notes["mapped"]) == 3
    # a repair of a laid-out candidate on a model that draws layouts: the nearest region is redrawn
    answer = {"moves": [{"kind": "repair", "parent_id": "c3", "prompt": "a green square",
                         "area": {"x": 0.6, "y": 0.3, "w": 0.3, "h": 0.4}}]}
    with ScriptedLLM([chat(answer)]) as server:
        p = reviser(server).propose(ctx(hist=[*history(), laid_out], n=1))
    (d,) = p.candidates
    assert d.regions == (("a red circle", 0.25, 0.5), ("a green square", 0.75, 0.5)) and d.seed == 44


def test_extra_moves_are_dropped_with_a_note() -> None:
    moves = [{"kind": "prompt", "prompt": f"a red circle number {i}"} for i in range(5)]
    with ScriptedLLM([chat({"moves": moves})]) as server:
        p = reviser(server).propose(ctx(n=2))
    assert len(p.candidates) == 2 and len(p.notes["dropped"]) == 3


def test_without_an_endpoint_it_falls_back_and_goals_are_refused() -> None:
    p = get_reviser("llm").propose(ctx())
    assert p.notes["strategy"] == "search" and "no LLM endpoint" in p.notes["llm"]["fallback"]
    with pytest.raises(GoalInvalid, match="AGENTLOOP_LLM_BASE_URL"):
        spec(reviser="llm")
    configured = SETTINGS.model_copy(update={"llm_base_url": "http://127.0.0.1:9/v1", "llm_model": "m"})
    assert check_goal(GoalRequest(goal=GOAL, reviser="llm"), configured).reviser == "llm"
    with pytest.raises(ValueError, match="go together"):
        Settings(llm_base_url="http://127.0.0.1:8000/v1")


def test_the_first_iteration_is_asked_too() -> None:
    answer = {"moves": [{"kind": "prompt", "prompt": GOAL, "seed": "new"},
                        {"kind": "prompt", "prompt": "a red circle, a blue square", "seed": 3}]}
    with ScriptedLLM([chat(answer)]) as server:
        p = reviser(server).propose(ctx(hist=[], n=2, iteration=0))
    assert [d.seed for d in p.candidates] == [derive_seed(0, 0, 0, SEED_SALT), 3]
    assert server.situation()["best"] == [] and server.situation()["layouts_supported"] is True


def test_failed_candidates_are_no_parents() -> None:
    failed = replace(history()[0], id="c7", status=CandidateStatus.FAILED, clip_score=None)
    wrong = {"moves": [{"kind": "refine", "parent_id": "c7", "prompt": "a"}]}
    with ScriptedLLM([chat(wrong)]) as server:
        p = reviser(server, max_attempts=1).propose(ctx(hist=[*history(), failed]))
    assert "c7" in p.notes["llm"]["fallback"] and server.situation()["candidates_failed"] == 1


def test_an_answer_wrapped_in_reasoning_and_prose_is_read() -> None:
    wrapped = ("<think>The square scores low, so refine c0 {maybe}.</think>\nHere are the moves:\n"
               + json.dumps(GOOD) + "\nGood luck!")
    with ScriptedLLM([chat(wrapped)]) as server:
        p = reviser(server, response_format="none").propose(ctx())
    assert p.notes["strategy"] == "llm" and len(p.candidates) == 3
    assert "response_format" not in server.requests[0]


def test_parameters_a_server_refuses_are_adapted_once() -> None:
    openai_reasoning = Reply(400, {"error": {"message": "Unsupported parameter: 'max_tokens' is "
                                             "not supported with this model. Use "
                                             "'max_completion_tokens' instead."}})
    no_temperature = Reply(400, {"error": {"message": "Unsupported value: 'temperature' does not "
                                           "support 0.0 with this model."}})
    with ScriptedLLM([openai_reasoning, no_temperature, chat(GOOD), chat(GOOD)]) as server:
        r = reviser(server, max_attempts=3)
        assert r.propose(ctx()).notes["strategy"] == "llm"
        assert r.propose(ctx()).notes["llm"]["attempts"] == 1
    first, second, third, fourth = server.requests
    assert "max_tokens" in first and "max_completion_tokens" in second and "temperature" in second
    assert "temperature" not in third and "max_tokens" not in fourth and "temperature" not in fourth


def test_a_validator_that_breaks_ends_the_asking_and_falls_back() -> None:
    """Anything unexpected while asking (here a validator with a bug) is a failed call that
    falls back, never an error out of the orchestrator's step."""
    from agentloop.llm import ChatClient, ChatFailed

    def broken(data: Any) -> Any:
        raise KeyError("bug")

    with ScriptedLLM([chat(GOOD), chat(GOOD)]) as server:
        client = ChatClient(LlmConfig(server.url, "m", max_attempts=3, backoff_seconds=0.01))
        with pytest.raises(ChatFailed, match="KeyError") as failed:
            client.ask_json([{"role": "user", "content": "hi"}], ANSWER_SCHEMA, "x", broken)
    assert failed.value.usage.attempts == 1 and len(server.requests) == 1
