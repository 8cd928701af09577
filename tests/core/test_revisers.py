"""Revisers on hand-made histories: deterministic, within budget, guided by the scores."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from agentloop.domain import CandidateStatus, CandidateView, GoalRequest, check_goal, split_parts
from agentloop.revisers import ReviserContext, SearchReviser, derive_seed, get_reviser, objective
from agentloop.revisers.search import _edit_gains, goal_modifiers
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


def test_objective_counts_every_part_and_the_whole_goal_once() -> None:
    parts = ("a red circle on the left", "a blue square on the right", "a green ring at the top")
    scores = {parts[0]: 1.5, parts[1]: 1.2, parts[2]: 1.5}
    a = cand(0, "x", 1, 1.0, scores)
    b = cand(1, "x", 2, 1.0, {**scores, parts[2]: 1.2})  # same whole and weakest part
    c = cand(2, "x", 3, 1.3, {**scores, parts[0]: 1.2})  # whole +0.3, one part -0.3
    assert objective(a, parts) == pytest.approx((1.0 + 1.5 + 1.2 + 1.5) / 4)
    assert objective(a, parts) > objective(b, parts)  # the other parts count, not only the weakest
    assert objective(c, parts) == pytest.approx(objective(a, parts))  # the whole is one part more
    assert objective(a, parts[:2]) == pytest.approx((1.0 + 1.5 + 1.2) / 3)  # parts of the goal only


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


# noise variations -----------------------------------------------------------------------

GOAL = "a small red circle on the left"
HISTORY_A = [cand(0, GOAL, 11, 0.2), cand(1, GOAL + ", bold", 22, 0.9), cand(2, GOAL, 33, 0.4)]
HISTORY_B = [cand(0, GOAL, 1, 0.5), cand(1, f"{GOAL}, bold", 1, 0.9, parent="c0", edit="add:bold")]
# What SearchReviser proposed for these histories before variations existed:
# (prompt, seed, parent_id, edit), n=8 for A and n=6 for B.
EXPECTED_A = [
    ("a small very red circle on the left, bold", 22, "c1", "strengthen:red"),
    (f"{GOAL}, clear", 33, "c2", "add:clear"),
    (f"{GOAL}, bold", 512828232, "c1", "seed"),
    (f"{GOAL}, bold", 640752042, "c1", "seed"),
    (GOAL, 1781576833, None, "seed"),
    (f"{GOAL}, bold", 86768341, "c1", "seed"),
    (f"{GOAL}, bold", 1264273141, "c1", "seed"),
    (GOAL, 162290599, None, "seed"),
]
EXPECTED_B = [
    (f"{GOAL}, bold, red", 1, "c1", "add:red"),
    ("a very small red circle on the left", 1, "c0", "strengthen:small"),
    ("on the left, bold, a small red circle", 1, "c1", "reorder"),
    (f"{GOAL}, bold", 512828232, "c1", "seed"),
    (f"{GOAL}, bold", 640752042, "c1", "seed"),
    (GOAL, 1781576833, None, "seed"),
]


def _structure(p):  # noqa: ANN001,ANN202
    return [(d.prompt, d.seed, d.parent_id, d.edit) for d in p.candidates]


def test_without_a_variation_share_proposals_are_unchanged() -> None:
    s = spec(GOAL)
    for reviser in (SearchReviser(), SearchReviser(variation_share=0.0)):
        a = reviser.propose(ctx(s, HISTORY_A, n=8))
        b = reviser.propose(ctx(s, HISTORY_B, n=6))
        assert _structure(a) == EXPECTED_A and _structure(b) == EXPECTED_B
        drafts = a.candidates + b.candidates
        assert all(d.variation_seed is None and d.variation_strength == 0.0 for d in drafts)
        assert "variation_share" not in a.notes


def test_half_the_slots_go_to_variations_of_the_best_candidate() -> None:
    s = spec(GOAL)
    reviser = SearchReviser(variation_share=0.5)
    p = reviser.propose(ctx(s, HISTORY_A, n=8))
    assert _structure(p) == _structure(reviser.propose(ctx(s, HISTORY_A, n=8)))  # deterministic
    variations, others = p.candidates[:4], p.candidates[4:]
    best = HISTORY_A[1]
    for d in variations:
        assert (d.prompt, d.seed, d.negative_prompt, d.parent_id) == (best.prompt, 22, "", "c1")
        assert d.variation_strength == 0.35 and d.edit == "variation:0.35"
    variation_seeds = {d.variation_seed for d in variations}
    assert len(variation_seeds) == 4 and None not in variation_seeds
    assert all(d.variation_seed is None and d.edit and "variation" not in d.edit for d in others)
    # the other half is split as it would be without variations: a quarter of it on edits
    assert sum(d.edit != "seed" for d in others) == 1
    assert p.notes["edits"][:4] == ["variation:0.35"] * 4 and p.notes["variation_share"] == 0.5


def test_variations_are_not_duplicates_of_their_parent_but_are_of_each_other() -> None:
    s = spec(GOAL)
    reviser = SearchReviser(variation_share=0.5, variation_strength=0.2)
    first = reviser.propose(ctx(s, HISTORY_A, n=4)).candidates[:2]
    taken = first[0].variation_seed
    done = replace(
        cand(3, first[0].prompt, 22, 0.5, parent="c1", edit="variation:0.2"),
        params={"variation_seed": taken, "variation_strength": 0.2},
    )
    again = reviser.propose(ctx(s, [*HISTORY_A, done], n=4)).candidates[:2]
    assert [d.edit for d in again] == ["variation:0.2"] * 2
    assert taken not in {d.variation_seed for d in again}
    assert len({d.variation_seed for d in again}) == 2


def test_variation_gains_are_their_own_kind_and_not_prompt_edits() -> None:
    s = spec(GOAL)
    varied = replace(
        cand(1, GOAL, 1, 0.9, parent="c0", edit="variation:0.35"),
        params={"variation_seed": 9, "variation_strength": 0.35},
    )
    c = ctx(s, [cand(0, GOAL, 1, 0.5), varied])
    assert dict(_edit_gains(c)) == {"variation": [pytest.approx(0.4)]}
    assert SearchReviser()._edit_share(c) == 0.25  # no prompt edit scored yet
    # an edit of a variation keeps the variation's noise
    edit = SearchReviser()._edit(c, varied, ["add"], random.Random(0), set())
    assert edit is not None and edit.prompt != GOAL
    assert (edit.seed, edit.variation_seed, edit.variation_strength) == (1, 9, 0.35)


def test_variation_settings_are_checked() -> None:
    bad = ({"variation_share": 1.5}, {"variation_share": -0.1}, {"variation_strength": 0.0})
    for kwargs in (*bad, {"variation_strength": float("nan")}):
        with pytest.raises(ValueError, match="variation_"):
            SearchReviser(**kwargs)
