"""The search reviser's repair and refine moves, decided from part scores and past gains."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentloop.domain import CandidateDraft, split_parts
from agentloop.revisers import SearchReviser
from agentloop.revisers.search import failing_part
from tests.core.test_revisers import cand, ctx, spec

TWO = "a small red circle on the left and a large blue ring on the right"
PARTS = split_parts(TWO)
PLAN = ((PARTS[0], 0.25, 0.5), (PARTS[1], 0.75, 0.5))


def laid_out(i: int, seed: int, score: float, parts: dict[str, float], **kw):  # noqa: ANN003,ANN201
    c = cand(i, TWO, seed, score, parts, **kw)
    return replace(c, params={"regions": [list(r) for r in PLAN]}, artifact_uri=f"g/c{i}-1.png")


def test_failing_part_is_one_part_far_below_the_others() -> None:
    one_bad = laid_out(0, 1, 0.6, {PARTS[0]: 0.9, PARTS[1]: 0.5})
    assert failing_part(one_bad, PARTS, gap=0.1) == PARTS[1]
    close = laid_out(1, 2, 0.6, {PARTS[0]: 0.9, PARTS[1]: 0.85})
    assert failing_part(close, PARTS, gap=0.1) is None  # no part far below the other
    # with a pass score: the weak part must fail it and the others pass it
    assert failing_part(one_bad, PARTS, gap=0.1, pass_score=0.7) == PARTS[1]
    all_weak = laid_out(2, 3, 0.3, {PARTS[0]: 0.4, PARTS[1]: 0.2})
    assert failing_part(all_weak, PARTS, gap=0.1) == PARTS[1]
    assert failing_part(all_weak, PARTS, gap=0.1, pass_score=0.7) is None  # all weak
    assert failing_part(one_bad, PARTS[:1], gap=0.1) is None  # one part: nothing to compare


def test_a_layout_candidate_with_one_failing_part_gets_that_region_repaired() -> None:
    s = spec(TWO)
    history = [laid_out(0, 1, 0.8, {PARTS[0]: 0.9, PARTS[1]: 0.4}),
               laid_out(1, 2, 0.5, {PARTS[0]: 0.5, PARTS[1]: 0.45})]
    p = SearchReviser(repair=True, refine=True).propose(ctx(s, history, n=8))
    assert len(p.candidates) == 8
    repairs = [d for d in p.candidates if (d.edit or "").startswith("repair:")]
    assert len(repairs) == 4  # half the slots while repairs are untried
    for d in repairs:
        assert d.edit == f"repair:{PARTS[1]}" and d.parent_id == "c0"
        assert d.init_image == "g/c0-1.png" and d.repair_region == 1 and d.strength == 0.7
        assert d.regions == PLAN and d.prompt == TWO and d.seed != 1
    assert len({d.seed for d in repairs}) == 4
    assert p.notes["repair_targets"] == [{"id": "c0", "part": PARTS[1], "region": 1}]
    # the params a worker reads back
    params = repairs[0].noise_and_layout_params()
    assert params["init_image"] == "g/c0-1.png" and params["repair_region"] == 1
    refines = [d for d in p.candidates if d.edit == "refine"]
    assert len(refines) == 1 and refines[0].init_image == "g/c0-1.png"
    assert refines[0].strength == 0.6 and refines[0].regions == () and refines[0].repair_region is None
    assert refines[0].prompt.startswith(PARTS[1])  # the weak part first


def test_repair_and_refine_can_be_switched_off() -> None:
    s = spec(TWO)
    history = [laid_out(0, 1, 0.8, {PARTS[0]: 0.9, PARTS[1]: 0.4})]
    p = SearchReviser(repair=False, refine=False).propose(ctx(s, history, n=8))
    assert not [d for d in p.candidates if d.init_image is not None]
    assert "repair_targets" not in p.notes


def test_all_weak_parts_get_fresh_samples_not_repairs() -> None:
    s = spec(TWO)
    history = [laid_out(0, 1, 0.3, {PARTS[0]: 0.31, PARTS[1]: 0.3})]
    p = SearchReviser(repair=True).propose(ctx(s, history, n=6))
    assert not [d for d in p.candidates if (d.edit or "").startswith("repair")]
    assert [d for d in p.candidates if d.edit == "seed" and d.regions == PLAN]


def _repaired(i: int, parent: str, gain: float):  # noqa: ANN202
    child = laid_out(i, 100 + i, 0.8 + gain, {PARTS[0]: 0.9, PARTS[1]: 0.4 + 2 * gain},
                     parent=parent, edit=f"repair:{PARTS[1]}")
    return replace(child, params={**child.params, "init_image": f"g/{parent}-1.png",
                                  "strength": 1.0, "repair_region": 1})


@pytest.mark.parametrize(("gain", "expected"), [(0.2, 6), (-0.2, 2)])
def test_repairs_get_more_slots_once_they_paid_off_and_fewer_once_they_did_not(
    gain: float, expected: int
) -> None:
    s = spec(TWO)
    parent = laid_out(0, 1, 0.8, {PARTS[0]: 0.9, PARTS[1]: 0.4})
    # the repairs so far: children of c0 that gained (or lost) on the objective; their own
    # weak part is still far below the other, so each is a target too
    history = [parent, _repaired(1, "c0", gain), _repaired(2, "c0", gain)]
    p = SearchReviser(repair=True).propose(ctx(s, history, n=8, iteration=2))
    repairs = [d for d in p.candidates if (d.edit or "").startswith("repair:")]
    assert len(repairs) == expected
    # the objective's gain: the mean of the whole goal's (g) and each part's (0 and 2g)
    assert p.notes["repair_mean_gain"] == pytest.approx((gain + 0 + 2 * gain) / 3, abs=1e-3)
    # never the same repair twice: fresh seeds, distinct identities
    assert len({(d.init_image, d.seed) for d in repairs}) == len(repairs)


def test_refines_stop_after_two_that_did_not_pay_off() -> None:
    s = spec(TWO)
    best = laid_out(0, 1, 0.8, {PARTS[0]: 0.85, PARTS[1]: 0.8})
    refined = [replace(cand(i, TWO, 50 + i, 0.5, {PARTS[0]: 0.5, PARTS[1]: 0.5}, parent="c0",
                            edit="refine"), params={"init_image": "g/c0-1.png", "strength": 0.6})
               for i in (1, 2)]
    reviser = SearchReviser(refine=True)
    assert [d for d in reviser.propose(ctx(s, [best], n=8)).candidates if d.edit == "refine"]
    p = reviser.propose(ctx(s, [best, *refined], n=8, iteration=2))
    assert not [d for d in p.candidates if d.edit == "refine"]


def test_a_goal_with_an_init_image_refines_it_in_every_iteration() -> None:
    s = replace(spec("a red circle"), init_image="uploads/abc.png", init_strength=0.4)
    first = SearchReviser().propose(ctx(s, [], n=4, iteration=0))  # whatever the switches
    assert first.notes["strategy"] == "refine"
    assert all(d.init_image == "uploads/abc.png" and d.strength == 0.4 and d.edit == "refine"
               and not d.regions for d in first.candidates)
    assert len({d.seed for d in first.candidates}) == 4
    history = [replace(cand(i, d.prompt, d.seed, 0.5 + i / 10, edit="refine"),
                       params=d.noise_and_layout_params(), artifact_uri=f"g/c{i}-1.png")
               for i, d in enumerate(first.candidates)]
    later = SearchReviser(variation_share=0.5, refine=True).propose(ctx(s, history, n=4))
    assert len(later.candidates) == 4
    # reseeds and edits keep the goal's image; no noise variations of an image-to-image goal
    for d in later.candidates:
        assert d.init_image is not None and d.variation_seed is None
        if d.edit != "refine":
            assert d.init_image == "uploads/abc.png" and d.strength == 0.4


def test_repair_settings_are_checked() -> None:
    for kwargs in ({"repair_strength": 0}, {"refine_strength": 1.5}, {"repair_gap": -1},
                   {"pass_score": 3.0}):
        with pytest.raises(ValueError):
            SearchReviser(**kwargs)  # type: ignore[arg-type]
    assert isinstance(CandidateDraft("x", 1).noise_and_layout_params(), dict)


def test_repair_and_refine_are_off_by_default() -> None:
    s = spec(TWO)
    history = [laid_out(0, 1, 0.8, {PARTS[0]: 0.9, PARTS[1]: 0.4})]
    default = SearchReviser().propose(ctx(s, history, n=8))
    explicit = SearchReviser(repair=False, refine=False).propose(ctx(s, history, n=8))
    assert default.candidates == explicit.candidates


def test_a_layout_with_size_words_is_repaired_in_the_right_region() -> None:
    """Size words give regions a fourth value, the scale ("a small ..." 0.85): the repair
    target is still found by the region's prompt (this once raised on unpacking)."""
    from agentloop.layout import plan_layout

    plan = plan_layout(PARTS)
    assert [len(entry) for entry in plan] == [4, 4]  # small: 0.85, large: 1.2
    c = replace(cand(0, TWO, 1, 0.8, {PARTS[0]: 0.9, PARTS[1]: 0.4}),
                params={"regions": [list(r) for r in plan]}, artifact_uri="g/c0-1.png")
    p = SearchReviser(repair=True).propose(ctx(spec(TWO), [c], n=4))
    repairs = [d for d in p.candidates if (d.edit or "").startswith("repair:")]
    assert repairs and all(d.repair_region == 1 and d.regions == plan for d in repairs)
