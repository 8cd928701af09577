"""Revisers on hand-made histories: deterministic, within budget, guided by the scores."""

from __future__ import annotations

from agentloop.domain import CandidateStatus, CandidateView, GoalRequest, check_goal, split_parts
from agentloop.revisers import ReviserContext, SearchReviser, derive_seed, get_reviser, objective
from agentloop.revisers.search import goal_modifiers
from agentloop.settings import Settings

SETTINGS = Settings(default_model="tiny-dit", default_scorer="tiny-clip")


def spec(goal: str = "a small red circle on the left", **kw):  # noqa: ANN003,ANN201
    return check_goal(GoalRequest(goal=goal, **kw), SETTINGS)


def cand(i: int, prompt: str, seed: int, score: float, parts=None, it=0, parent=None, edit=None):  # noqa: ANN001,ANN201
    return CandidateView(
        id=f"c{i}", goal_id="g", iteration=it, ordinal=i, prompt=prompt, negative_prompt="",
        seed=seed, params={}, status=CandidateStatus.SUCCEEDED, attempts=1, worker="w",
        clip_score=score, part_scores=parts or {}, artifact_uri=None, timings={}, error=None,
        parent_id=parent, edit=edit, queued_at=None, started_at=None, finished_at=None,
    )


def ctx(s, history, n=4, iteration=1):  # noqa: ANN001,ANN201
    return ReviserContext(s, split_parts(s.goal), iteration, n, history)


def test_first_iteration_is_the_goal_with_distinct_seeds() -> None:
    s = spec(seed=5)
    p = SearchReviser().propose(ctx(s, [], n=6, iteration=0))
    assert [d.prompt for d in p.candidates] == [s.goal] * 6
    assert len({d.seed for d in p.candidates}) == 6


def test_deterministic_and_never_repeats_a_prompt_seed_pair() -> None:
    s = spec()
    history = [cand(i, s.goal, derive_seed(0, 0, i), 0.5 + 0.01 * i) for i in range(4)]
    a = SearchReviser().propose(ctx(s, history, n=8))
    b = SearchReviser().propose(ctx(s, history, n=8))
    assert [(d.prompt, d.seed, d.edit) for d in a.candidates] == [(d.prompt, d.seed, d.edit) for d in b.candidates]
    pairs = [(d.prompt, d.seed) for d in a.candidates]
    assert len(pairs) == 8 == len(set(pairs))
    assert not set(pairs) & {(c.prompt, c.seed) for c in history}


def test_builds_on_the_best_candidate() -> None:
    s = spec()
    history = [cand(0, s.goal, 11, 0.2), cand(1, s.goal + ", bold", 22, 0.9), cand(2, s.goal, 33, 0.4)]
    p = SearchReviser().propose(ctx(s, history, n=4))
    edits = [d for d in p.candidates if d.edit != "seed"]
    reseeds = [d for d in p.candidates if d.edit == "seed"]
    assert len(edits) == 1 and len(reseeds) == 3  # a quarter on edits until edits prove useful
    assert edits[0].parent_id == "c1" and edits[0].seed == 22  # edits keep the parent's seed
    assert reseeds[0].prompt == s.goal + ", bold"  # the best prompt gets fresh seeds first
    assert p.notes["best_so_far"]["id"] == "c1"


def test_multi_part_goal_emphasizes_the_weakest_part() -> None:
    s = spec("a red circle on the left and a blue square at the top")
    parts = split_parts(s.goal)
    history = [cand(0, s.goal, 1, 0.8, {parts[0]: 0.9, parts[1]: 0.1})]
    p = SearchReviser().propose(ctx(s, history, n=8))
    emphasized = [d for d in p.candidates if (d.edit or "").startswith("emphasize")]
    assert emphasized and emphasized[0].prompt == "a blue square at the top and a red circle on the left"


def test_objective_penalizes_a_missing_part() -> None:
    parts = ("a red circle", "a blue square")
    both = cand(0, "x", 1, 0.7, {parts[0]: 0.6, parts[1]: 0.6})
    one = cand(1, "x", 2, 0.8, {parts[0]: 0.9, parts[1]: 0.0})
    assert objective(both, parts) > objective(one, parts)
    assert objective(one, ()) == 0.8


def test_edit_share_follows_the_evidence() -> None:
    s = spec()
    r = SearchReviser()
    base = [cand(0, s.goal, 1, 0.5)]
    helped = base + [cand(1, f"{s.goal}, bold", 1, 0.9, parent="c0", edit="add:bold")]
    hurt = base + [cand(1, f"{s.goal}, bold", 1, 0.1, parent="c0", edit="add:bold")]
    assert r._edit_share(ctx(s, base)) == 0.25
    assert r._edit_share(ctx(s, helped)) == 0.5
    assert r._edit_share(ctx(s, hurt)) == 0.125
    assert sum(d.edit != "seed" for d in r.propose(ctx(s, hurt, n=8)).candidates) == 1


def test_edit_kinds_that_helped_are_preferred() -> None:
    s = spec()
    r = SearchReviser()
    history = [cand(0, s.goal, 1, 0.5)]
    history += [cand(i, f"{s.goal}, w{i}", 1, 0.9, parent="c0", edit=f"add:w{i}") for i in (1, 2)]
    history += [cand(3, s.goal.replace("red", "very red"), 1, 0.1, parent="c0", edit="strengthen:red")]
    weights = r._edit_weights(ctx(s, history))
    assert weights["add"] > 1.0 > weights["strengthen"]


def test_goal_modifiers_and_registry() -> None:
    assert goal_modifiers((), "a small red circle on the left") == ["small", "red"]
    assert get_reviser("external").propose(ctx(spec(reviser="external"), [])).candidates == []


def test_reorder_moves_the_prepositional_phrase_to_the_front() -> None:
    from agentloop.revisers.search import _front_prepositional

    assert _front_prepositional("a small red circle on the left") == "on the left, a small red circle"
    assert _front_prepositional("a red circle") is None
