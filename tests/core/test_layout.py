"""Layout planning from a goal's position words, and the search reviser's use of layouts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from agentloop.domain import CandidateDraft, split_parts
from agentloop.layout import anchor_of, plan_layout
from agentloop.orchestrator import submit_iteration
from agentloop.revisers import SearchReviser
from agentloop.store import Store
from engine.catalog import draws_layouts
from engine.types import Region
from tests.core.helpers import make_goal
from tests.core.test_revisers import cand, ctx, spec
from workers.jobs import _request

TWO = "a small red circle on the left and a large blue ring at the top"
PLAN = (("a small red circle on the left", 0.25, 0.5, 0.85),
        ("a large blue ring at the top", 0.5, 0.25, 1.2))  # size words scale the regions


@pytest.mark.parametrize(
    ("part", "anchor"),
    [
        ("a red circle on the left", (0.25, 0.5)),
        ("to the right, a box", (0.75, 0.5)),
        ("a ring on top", (0.5, 0.25)),
        ("a cross in the lower part", (0.5, 0.75)),
        ("a disc in the middle", (0.5, 0.5)),
        ("a dog in the top left corner", (0.25, 0.25)),
        ("a cat at the bottom right", (0.75, 0.75)),
        ("a red circle", None),  # no position
        ("a line from left to right", None),  # two opposite sides
        ("bluetop leftover", None),  # whole words only
    ],
)
def test_anchor_of_reads_position_words(part: str, anchor: tuple[float, float] | None) -> None:
    assert anchor_of(part) == anchor


def test_the_api_allows_as_many_regions_as_the_engine() -> None:
    from agentloop import layout
    from engine import types

    assert layout.MAX_REGIONS == types.MAX_REGIONS


def test_plan_needs_two_parts_in_distinct_places() -> None:
    assert plan_layout(split_parts(TWO)) == PLAN
    assert plan_layout(("a red circle on the left",)) is None  # one part: nothing to lay out
    # an unplaced part gets the place across from the placed one
    assert plan_layout(("a red circle on the left", "a blue square")) == (
        ("a red circle on the left", 0.25, 0.5), ("a blue square on the right", 0.75, 0.5))
    assert plan_layout(("a red circle on the left", "a blue square to the left")) is None
    nine = tuple(f"a dot at the {v} {h}".replace("  ", " ") for v in ("top", "", "bottom")
                 for h in ("left", "center", "right"))
    assert len({anchor_of(p) for p in nine}) == 9
    assert plan_layout(nine) is None and plan_layout(nine[:8]) is not None  # at most 8 regions


def test_first_iteration_splits_between_the_goal_text_and_its_layout() -> None:
    s = spec(TWO, seed=3)
    p = SearchReviser(layout_share=0.5).propose(ctx(s, [], n=4, iteration=0))
    plain = [d for d in p.candidates if not d.regions]
    laid_out = [d for d in p.candidates if d.regions]
    assert len(plain) == len(laid_out) == 2
    assert all(d.prompt == s.goal and d.edit == "seed" for d in plain)
    assert all(d.prompt == s.goal and d.regions == PLAN and d.edit == "layout" for d in laid_out)
    assert len({d.seed for d in laid_out}) == 2
    assert p.notes["layout"] == [list(r) for r in PLAN]
    # n = 1 rounds half up: the one slot goes to the layout
    one = SearchReviser(layout_share=0.5).propose(ctx(s, [], n=1, iteration=0)).candidates
    assert [d.regions for d in one] == [PLAN]
    # by default every slot of the first iteration goes to the layout
    default = SearchReviser().propose(ctx(s, [], n=4, iteration=0)).candidates
    assert [d.regions for d in default] == [PLAN] * 4 and len({d.seed for d in default}) == 4


def test_no_layout_without_a_plan_a_model_that_draws_one_or_a_share() -> None:
    one = spec("a small red circle on the left")
    assert not any(d.regions for d in SearchReviser().propose(ctx(one, [], n=4, iteration=0)).candidates)
    two = spec(TWO)
    drafts = SearchReviser(layout_share=0.0).propose(ctx(two, [], n=4, iteration=0)).candidates
    assert not any(d.regions for d in drafts) and len(drafts) == 4
    unet = spec(TWO, model="tiny-unet")  # a StableDiffusionPipeline: the runner would refuse
    drafts = SearchReviser().propose(ctx(unet, [], n=4, iteration=0)).candidates
    assert not any(d.regions for d in drafts) and len(drafts) == 4


def test_the_catalog_knows_which_models_draw_layouts(tmp_path) -> None:  # noqa: ANN001
    assert draws_layouts("tiny-dit") and draws_layouts("shapes")
    assert not draws_layouts("tiny-unet") and not draws_layouts("no-such-model")
    assert not draws_layouts("org/flux", extra_models=["org/flux"])  # unknown until downloaded
    for cls, expected in (("FluxPipeline", True), ("StableDiffusionPipeline", False)):
        folder = tmp_path / cls
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": cls}))
        assert draws_layouts(str(folder)) is expected
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model_index.json").write_text("{not json")
    assert draws_layouts(str(broken)) is False
    with pytest.raises(ValueError, match="layout_share"):
        SearchReviser(layout_share=1.5)


def _laid_out(i: int, seed: int, score: float, **kw):  # noqa: ANN003,ANN202
    c = cand(i, TWO, seed, score, **kw)
    return replace(c, params={"regions": [list(r) for r in PLAN]})


def test_a_winning_layout_is_reseeded_and_varied_with_its_layout_but_never_prompt_edited() -> None:
    s = spec(TWO)
    parts = split_parts(TWO)
    history = [
        cand(0, TWO, 1, 0.5, {parts[0]: 0.5, parts[1]: 0.1}),
        _laid_out(1, 1, 0.9, parts={parts[0]: 0.9, parts[1]: 0.8}),  # same seed, other image
    ]
    reviser = SearchReviser(variation_share=0.25)
    p = reviser.propose(ctx(s, history, n=8))
    assert len(p.candidates) == 8
    variations = [d for d in p.candidates if (d.edit or "").startswith("variation")]
    assert len(variations) == 2
    assert all(d.regions == PLAN and d.seed == 1 and d.parent_id == "c1" for d in variations)
    layout_reseeds = [d for d in p.candidates if d.edit == "seed" and d.regions]
    assert layout_reseeds and all(d.parent_id == "c1" and d.seed != 1 for d in layout_reseeds)
    edits = [d for d in p.candidates if d.edit not in ("seed", None) and d not in variations]
    assert edits and all(not d.regions and d.parent_id == "c0" for d in edits)
    identities = [(d.prompt, d.seed, d.variation_seed, d.regions) for d in p.candidates]
    assert len(set(identities)) == 8


def test_a_layout_round_trips_into_params_and_the_request(db_url: str, settings) -> None:  # noqa: ANN001
    store = Store(db_url)
    try:
        goal_id = make_goal(store, settings, reviser="external", budget=2, steps=2)
        decision = submit_iteration(
            store, goal_id, [CandidateDraft(TWO, 5, regions=PLAN), CandidateDraft(TWO, 5)]
        )
        assert decision is not None and len(decision.dispatch) == 2
        laid_out, plain = store.list_candidates(goal_id)
        assert laid_out.params["regions"] == [list(r) for r in PLAN]
        assert "regions" not in plain.params
        request = _request(laid_out)
        assert request.regions == tuple(Region(*r) for r in PLAN)
        assert request.prompt == TWO and request.denoiser_passes == 2
        assert _request(plain).regions == () and _request(plain).denoiser_passes == 1
        assert request.batch_key() != _request(plain).batch_key()
    finally:
        store.dispose()
