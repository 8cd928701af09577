"""Goals read into parts and places (the rule parser), the planner that places every part,
and where each part is judged (`part_regions`)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agentloop.domain import CandidateDraft, entry_values, layout_entry, split_parts
from agentloop.layout import FREE_PLACES, place_parts, plan_layout
from agentloop.parts import (
    PARSERS,
    Part,
    RuleParser,
    contrast_subjects,
    get_parser,
    goal_parts,
    part_contrasts,
    part_regions,
    part_texts,
    register_parser,
)

LEFT, RIGHT, TOP, BOTTOM, CENTER = (0.25, 0.5), (0.75, 0.5), (0.5, 0.25), (0.5, 0.75), (0.5, 0.5)


OBJECTS_FOR_BARE = st.sampled_from(["circle", "square", "cat", "dog", "ring", "house", "tree", "box"])


def parse(text: str) -> list[tuple[str, tuple[float, float] | None]]:
    return [(p.subject, p.place) for p in RuleParser().parse(text)]


@pytest.mark.parametrize(
    ("goal", "expected"),
    [
        ("a red circle and a blue square", [("a red circle", None), ("a blue square", None)]),
        ("a red circle, a blue square", [("a red circle", None), ("a blue square", None)]),
        ("a red circle with a blue square", [("a red circle", None), ("a blue square", None)]),
        ("a red circle plus a blue square", [("a red circle", None), ("a blue square", None)]),
        ("a red circle next to a blue square", [("a red circle", None), ("a blue square", None)]),
        ("a red circle alongside a blue square", [("a red circle", None), ("a blue square", None)]),
        ("a red circle as well as a blue square", [("a red circle", None), ("a blue square", None)]),
        ("a red circle together with a blue square",
         [("a red circle", None), ("a blue square", None)]),
        ("a cat, a dog and a bird", [("a cat", None), ("a dog", None), ("a bird", None)]),
        ("a cat, a dog, and a bird", [("a cat", None), ("a dog", None), ("a bird", None)]),
        ("a red circle on the left and a blue square at the top",
         [("a red circle", LEFT), ("a blue square", TOP)]),
        ("on the left, a small red circle and to the right, a blue ring, large",
         [("a small red circle", LEFT), ("a blue ring, large", RIGHT)]),
        ("a red circle that is small, on the left and a blue box in the upper part",
         [("a red circle that is small", LEFT), ("a blue box", TOP)]),
        ("a red circle and on the left, a small blue square",
         [("a red circle", None), ("a small blue square", LEFT)]),
        ("a cat in the top left corner, plus a dog at the bottom right side",
         [("a cat", (0.25, 0.25)), ("a dog", (0.75, 0.75))]),
        ("a tree at the left side of the image with a house in the middle",
         [("a tree", LEFT), ("a house", CENTER)]),
        ("a red circle above a blue square", [("a red circle", TOP), ("a blue square", BOTTOM)]),
        ("a red circle below a blue square", [("a red circle", BOTTOM), ("a blue square", TOP)]),
        ("a lamp to the left of a sofa", [("a lamp", LEFT), ("a sofa", RIGHT)]),
        ("a lamp to the right of a sofa", [("a lamp", RIGHT), ("a sofa", LEFT)]),
        ("a picture of a red circle and a blue square",
         [("a red circle", None), ("a blue square", None)]),
        ("there is a red circle near the top and a blue square near the bottom",
         [("a red circle", TOP), ("a blue square", BOTTOM)]),
        ("a tiny red circle and a huge blue square, on a white background",
         [("a tiny red circle", None), ("a huge blue square", None)]),
        ("a red circle and also a blue square", [("a red circle", None), ("a blue square", None)]),
        ("a red circle & a blue square", [("a red circle", None), ("a blue square", None)]),
        # requests around the objects are framing, not part of the first one
        ("please draw a red circle and a blue square",
         [("a red circle", None), ("a blue square", None)]),
        ("could you please draw me a picture of a red circle and a blue square!",
         [("a red circle", None), ("a blue square", None)]),
        ("can you make a red circle and a blue square?",
         [("a red circle", None), ("a blue square", None)]),
        ("I would like to see a red circle above a blue square",
         [("a red circle", TOP), ("a blue square", BOTTOM)]),
        ("put a red circle on the left and a blue square on the right",
         [("a red circle", LEFT), ("a blue square", RIGHT)]),
        ("give me two red circles and a blue square",
         [("a red circle", None), ("a red circle", None), ("a blue square", None)]),
        ("place setting with a red plate and a blue cup",  # a verb only before a determiner
         [("place setting", None), ("a red plate", None), ("a blue cup", None)]),
        # a request verb before an article-free list, and bracketed places
        ("draw red circle and blue square", [("red circle", None), ("blue square", None)]),
        ("Create small red circle, blue square and green triangle",
         [("small red circle", None), ("blue square", None), ("green triangle", None)]),
        ("paint splatter and red splash",  # the rest alone is no list: "paint" stays
         [("paint splatter", None), ("red splash", None)]),
        ("draw a red circle (left) and a blue square (top right)",
         [("a red circle", LEFT), ("a blue square", (0.75, 0.25))]),
        ("a red circle (on the left), a blue square (right side)",
         [("a red circle", LEFT), ("a blue square", RIGHT)]),
        ("a cat (sleeping) and a dog", [("a cat (sleeping)", None), ("a dog", None)]),
        # places as labels, as side words after every object, or for the pair
        ("left: red circle, right: blue square", [("red circle", LEFT), ("blue square", RIGHT)]),
        ("left: a red circle and right: a blue square",
         [("a red circle", LEFT), ("a blue square", RIGHT)]),
        ("Top: a big red circle. Bottom: a small blue square.",
         [("a big red circle", TOP), ("a small blue square", BOTTOM)]),
        ("the top left: a red circle; bottom right: a blue square",
         [("a red circle", (0.25, 0.25)), ("a blue square", (0.75, 0.75))]),
        ("red circle left, blue square right", [("red circle", LEFT), ("blue square", RIGHT)]),
        ("red circle top, blue square bottom", [("red circle", TOP), ("blue square", BOTTOM)]),
        ("red circle on left, blue square on right",
         [("red circle", LEFT), ("blue square", RIGHT)]),
        ("a red spinning top and a blue ball",  # not every object ends in a side word
         [("a red spinning top", None), ("a blue ball", None)]),
        ("a red circle and a blue square side by side",
         [("a red circle", LEFT), ("a blue square", RIGHT)]),
        ("a red circle and a blue square, stacked",
         [("a red circle", TOP), ("a blue square", BOTTOM)]),
        ("a cat looking left and right and a dog",  # not closing the goal: no pair's places
         [("a cat looking left and right", None), ("a dog", None)]),
        # an arrangement of any number of objects: evenly spaced, in the goal's order (two or
        # three at the place words' own anchors, more in equal bands)
        ("a cat, a dog and a bird side by side",
         [("a cat", LEFT), ("a dog", CENTER), ("a bird", RIGHT)]),
        ("a red circle, a blue square and a green ring in a row",
         [("a red circle", LEFT), ("a blue square", CENTER), ("a green ring", RIGHT)]),
        ("a red circle, a blue square and a green ring, stacked vertically.",
         [("a red circle", TOP), ("a blue square", CENTER), ("a green ring", BOTTOM)]),
        ("a cup and a plate in a column", [("a cup", TOP), ("a plate", BOTTOM)]),
        ("a lamp, a sofa and a plant from left to right",
         [("a lamp", LEFT), ("a sofa", CENTER), ("a plant", RIGHT)]),
        ("four cups in a row", [("a cup", (k / 8, 0.5)) for k in (1, 3, 5, 7)]),
        ("three red circles in a row",
         [("a red circle", LEFT), ("a red circle", CENTER), ("a red circle", RIGHT)]),
        ("a red circle on the left and a blue square, side by side",  # placed already: words stay
         [("a red circle", LEFT), ("a blue square, side by side", None)]),
        ("a row of houses and a tree", [("a row of houses", None), ("a tree", None)]),
        # a count told apart item by item (after a colon, or each item opening with "one")
        ("three circles in a row: red, green and blue",
         [("a red circle", LEFT), ("a green circle", CENTER), ("a blue circle", RIGHT)]),
        ("a pair of circles, one red and one blue", [("a red circle", None), ("a blue circle", None)]),
        ("Two cats: one black, one white.", [("a black cat", None), ("a white cat", None)]),
        ("two squares, one on the left and one on the right",
         [("a square", LEFT), ("a square", RIGHT)]),
        ("two circles, one small and one large, stacked",
         [("a small circle", TOP), ("a large circle", BOTTOM)]),
        ("two circles, highly detailed and sharp",  # modifiers, not items: one noun, counted
         [("a circle, highly detailed and sharp", None)] * 2),
        # labels as sentences or with a dash
        ("left: red circle. right: blue square.", [("red circle", LEFT), ("blue square", RIGHT)]),
        ("Left: red circle. Right: blue square. Top: green ring.",
         [("red circle", LEFT), ("blue square", RIGHT), ("green ring", TOP)]),
        ("left - red circle; right - blue square", [("red circle", LEFT), ("blue square", RIGHT)]),
        # sentences, "and then", a colon after the request
        ("A red circle. A blue square.", [("A red circle", None), ("A blue square", None)]),
        ("a red circle, and then a blue square", [("a red circle", None), ("a blue square", None)]),
        ("Draw: a red circle and a blue square.", [("a red circle", None), ("a blue square", None)]),
        ("a 2.5 inch cube and a red ball", [("a 2.5 inch cube", None), ("a red ball", None)]),
        # article-free lists: every phrase two words or more
        ("red circle and blue square", [("red circle", None), ("blue square", None)]),
        ("Red circle & blue square", [("Red circle", None), ("blue square", None)]),
        ("red circle plus blue square", [("red circle", None), ("blue square", None)]),
        ("red circle; blue square", [("red circle", None), ("blue square", None)]),
        ("red circle, blue square, and green triangle",
         [("red circle", None), ("blue square", None), ("green triangle", None)]),
        ("small red circle on the left and big blue square at the top",
         [("small red circle", LEFT), ("big blue square", TOP)]),
        ("two red circles and blue square",
         [("a red circle", None), ("a red circle", None), ("blue square", None)]),
        ("red circle and blue square on a white background",
         [("red circle", None), ("blue square", None)]),
        ("red circle and blue square, highly detailed",  # a modifier after the list
         [("red circle", None), ("blue square, highly detailed", None)]),
        # one object: "and" inside a noun phrase, "plus sign", a place, a modifier
        ("a black and white cat", [("a black and white cat", None)]),
        ("a red and blue circle", [("a red and blue circle", None)]),
        ("salt and pepper shaker", [("salt and pepper shaker", None)]),
        ("dark blue and light green stripes", [("dark blue and light green stripes", None)]),
        ("a cat, highly detailed, sharp focus", [("a cat, highly detailed, sharp focus", None)]),
        ("a red plus sign on the left", [("a red plus sign", LEFT)]),
        ("a red circle on the left, small", [("a red circle, small", LEFT)]),
        ("a red circle on the left side of the picture", [("a red circle", LEFT)]),
    ],
)
def test_rule_parser_reads_parts_and_places(goal: str, expected: list) -> None:
    assert parse(goal) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["red", "blue", "green", "small", "large"]), OBJECTS_FOR_BARE),
                min_size=2, max_size=4),
       st.sampled_from([" and ", " & ", " plus ", "; "]))
def test_article_free_lists_parse_back(objects, last) -> None:  # noqa: ANN001
    phrases = [f"{adjective} {noun}" for adjective, noun in objects]
    goal = ", ".join(phrases[:-1]) + last + phrases[-1]
    assert [p.subject for p in RuleParser().parse(goal)] == phrases, goal


def test_counts_become_one_part_each_with_distinct_keys() -> None:
    parts = RuleParser().parse("two red circles and a blue box")
    assert [p.subject for p in parts] == ["a red circle", "a red circle", "a blue box"]
    assert len({p.text for p in parts}) == 3  # part scores are keyed by text
    assert [p.subject for p in RuleParser().parse("3 small dogs")] == ["a small dog"] * 3
    assert [p.subject for p in RuleParser().parse("a pair of boxes")] == ["a box"] * 2
    assert goal_parts("a red circle") == () and split_parts("a red circle") == ()
    assert len(RuleParser().parse(", ".join(["a dot"] * 9))) == 0  # more than 8: not split


def test_size_words_set_the_scale() -> None:
    small, large, plain = RuleParser().parse("a small cat, a big dog and a bird")
    assert small.scale < 1 < large.scale and plain.scale == 1
    tiny, huge = RuleParser().parse("a tiny ant and a huge whale")
    assert tiny.scale < small.scale and huge.scale > large.scale


def test_split_parts_and_part_texts_agree_with_the_parser() -> None:
    goal = "a red circle on the left, plus a blue square"
    assert split_parts(goal) == part_texts(goal) == ("a red circle on the left", "a blue square")


OBJECTS = st.sampled_from(["circle", "square", "cat", "dog", "ring", "house", "tree", "box"])
COLORS = st.sampled_from(["red", "blue", "green", "", "small", "large"])
PLACES = st.sampled_from([
    ("on the left", LEFT), ("to the left", LEFT), ("at the left side", LEFT),
    ("on the right", RIGHT), ("at the top", TOP), ("on top", TOP), ("near the bottom", BOTTOM),
    ("in the lower part", BOTTOM), ("in the center", CENTER), ("in the middle", CENTER),
    ("in the top left corner", (0.25, 0.25)), ("at the bottom right", (0.75, 0.75)), ("", None),
])
JOINERS = st.sampled_from([" and ", ", ", " with ", " plus ", " as well as ", " together with ",
                           " alongside ", " next to ", ", and ", "; "])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(COLORS, OBJECTS, PLACES, st.booleans()), min_size=2, max_size=4),
       st.lists(JOINERS, min_size=3, max_size=3))
def test_any_joining_and_place_order_parses_back(objects, joiners) -> None:  # noqa: ANN001
    phrases = []
    for adjective, noun, (place, _), place_first in objects:
        words = " ".join(w for w in ("a", adjective, noun) if w)
        phrases.append(f"{place}, {words}" if place and place_first else
                       f"{words} {place}".strip())
    goal = phrases[0]
    for k, (phrase, joiner) in enumerate(zip(phrases[1:], joiners, strict=False)):
        # "a cat, on the left, a dog": the place could end the cat's phrase or open the dog's
        ambiguous = joiner == ", " and objects[k + 1][3] and objects[k + 1][2][1] is not None
        assume(not (ambiguous and objects[k][2][1] is None))
        goal += joiner + phrase
    parts = RuleParser().parse(goal)
    assert [p.place for p in parts] == [place for _, _, (_, place), _ in objects], goal
    assert [p.subject for p in parts] == [
        " ".join(w for w in ("a", a, n) if w) for a, n, _, _ in objects], goal


def test_the_planner_places_unplaced_parts_distinctly() -> None:
    two = place_parts(RuleParser().parse("a red circle next to a blue square"))
    assert two is not None and [p.place for p in two] == [LEFT, RIGHT]
    three = place_parts(RuleParser().parse("a cat, a dog and a bird"))
    assert three is not None and [p.place for p in three] == [LEFT, RIGHT, TOP]
    across = place_parts(RuleParser().parse("a red circle at the top and a blue square"))
    assert across is not None and [p.place for p in across] == [TOP, BOTTOM]
    mixed = place_parts(RuleParser().parse("a cat, a dog on the left and a bird"))
    assert mixed is not None and [p.place for p in mixed] == [RIGHT, LEFT, TOP]
    assert place_parts(RuleParser().parse("a cat on the left and a dog on the left")) is None
    many = place_parts(RuleParser().parse(", ".join(["a dot"] * 8)))
    assert many is not None and len({p.place for p in many}) == 8
    assert {p.place for p in many} <= set(FREE_PLACES)


def test_a_plan_draws_each_part_at_its_place_with_its_scale() -> None:
    plan = plan_layout(goal_parts("a small red circle next to a large blue ring"))
    assert plan == (("a small red circle on the left", 0.25, 0.5, 0.85),
                    ("a large blue ring on the right", 0.75, 0.5, 1.2))
    stated = plan_layout(goal_parts("on the left, a red circle and a blue ring at the top"))
    assert stated == (("on the left, a red circle", 0.25, 0.5), ("a blue ring at the top", 0.5, 0.25))
    assert plan_layout(goal_parts("a red circle")) is None


def test_layout_entries_keep_three_values_at_scale_one() -> None:
    assert layout_entry("a", 0.25, 0.5) == ("a", 0.25, 0.5)
    assert layout_entry("a", 0.25, 0.5, 1.2) == ("a", 0.25, 0.5, 1.2)
    assert entry_values(["a", 0, 1]) == ("a", 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="prompt, x, y"):
        entry_values(["a", 0])
    draft = CandidateDraft("x", 1, regions=(("a", 0.25, 0.5), ("b", 0.75, 0.5, 1.5)))
    assert draft.noise_and_layout_params()["regions"] == [["a", 0.25, 0.5], ["b", 0.75, 0.5, 1.5]]


def test_part_regions_judge_a_layout_by_its_regions_else_by_the_goals_places() -> None:
    parts = goal_parts("a red circle on the left and a blue square")
    layout = (("a red circle on the left", 0.25, 0.5), ("a blue square on the right", 0.75, 0.5, 1.2))
    assert part_regions(parts, layout) == (("a red circle on the left", 0.25, 0.5, 1.0),
                                           ("a blue square on the right", 0.75, 0.5, 1.2))
    # a plain candidate: the placed part on its region, the other on the whole image
    assert part_regions(parts) == (("a red circle on the left", 0.25, 0.5, 1.0), None)
    assert part_regions(goal_parts("a cat and a dog")) == ()
    assert part_regions(()) == ()


def test_parsers_are_plug_ins_by_name() -> None:
    class Halves:
        name = "halves-test"

        def parse(self, text: str) -> tuple[Part, ...]:
            left, _, right = text.partition(" | ")
            return (Part(left, left, (0.25, 0.5)), Part(right, right, (0.75, 0.5)))

    register_parser(Halves())
    try:
        assert get_parser("halves-test") is PARSERS["halves-test"]
        assert part_texts("x | y", "halves-test") == ("x", "y")
    finally:
        del PARSERS["halves-test"]
        goal_parts.cache_clear()
    with pytest.raises(ValueError, match="unknown goal parser 'nope'; known: \\['rules'\\]"):
        goal_parts("a and b", "nope")


def test_contrasts_bind_the_goals_own_words_to_the_wrong_part() -> None:
    """Hard negatives come from the goal's words, whatever they are: the other part's noun
    with this part's modifiers, each modifier swapped (aligned from the noun), all swapped,
    and the other part itself."""
    negs = contrast_subjects("a small red circle", ["a large blue ring"])
    assert negs == ["a small red ring", "a small blue circle", "a large red circle",
                    "a large blue circle", "a large blue ring"]
    assert contrast_subjects("a cat", ["a black dog"]) == ["a dog", "a black dog"]
    assert contrast_subjects("a fluffy cat, sleeping", ["a dog"]) == ["a fluffy dog, sleeping", "a dog"]
    assert contrast_subjects("a red circle", ["a red circle"]) == []  # nothing differs
    assert contrast_subjects("the", ["a dog"]) == []  # no noun phrase


def test_part_contrasts_keep_each_parts_place_words() -> None:
    parts = goal_parts("a small blue square at the top and a large red ring at the bottom")
    judged = tuple(p.text for p in parts)
    square, ring = part_contrasts(parts, judged)
    assert "a small blue ring at the top" in square and "a small red square at the top" in square
    assert "a large red square at the bottom" in ring
    assert all(t.endswith("at the top") for t in square)
    assert all(t.endswith("at the bottom") for t in ring)
