"""A goal's parts and their places: "a red circle on the left, plus a big blue square" → two
parts, each an object phrase with its place in the image (where stated) and its size.

The parse decides what the loop verifies (a score per part) and what a layout draws (a region
per part). Parsers are plug-ins (`GoalParser`), registered by name; settings pick one
(`Settings.goal_parser`, default "rules"). The rule parser knows no vocabulary of objects: it
reads the grammar around them (joining words, determiners, numbers, place phrases, size
words), so "a cat next to two dogs" parses as well as the shapes world's captions.

A parser must be deterministic for a given text: the orchestrator and the workers parse the
goal again at every step (a cache keeps that cheap), and part scores are keyed by part text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Protocol

Anchor = tuple[float, float]
"""(x, y) in [0, 1] from the top-left corner."""

HORIZONTAL: dict[str, float] = {"left": 0.25, "right": 0.75}
VERTICAL: dict[str, float] = {"top": 0.25, "upper": 0.25, "bottom": 0.75, "lower": 0.75}
CENTER = frozenset({"center", "centre", "middle"})

SIZE_SCALES: dict[str, float] = {
    "tiny": 0.7, "small": 0.85, "little": 0.85, "large": 1.2, "big": 1.2, "huge": 1.4,
    "giant": 1.4, "enormous": 1.4,
}
"""How much of the image a part's region claims, by size word (1 without one): a region of
scale s reaches s times as far from its anchor (`engine.regions.region_weights`)."""

NUMBERS: dict[str, int] = {
    "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "2": 2, "3": 3, "4": 4, "5": 5, "6": 6, "7": 7, "8": 8, "a pair of": 2, "a couple of": 2,
}
"""Counts a part may ask for; a counted part becomes that many parts."""

MAX_PARTS = 8
"""Most parts a goal parses into (the engine's most regions); a longer list is not split."""

DETERMINERS = ("a", "an", "the", "one", "another", "some", "this", "that", "its", *NUMBERS)
_DET = r"(?:a pair of|a couple of|an?|the|one|another|some|two|three|four|five|six|seven|eight|[2-8])"

# Joining words that start a new object when a noun phrase follows ("with a blue square",
# "plus two rings"); "a black and white cat", "a plus sign" and "a ring with red" stay one.
_JOINERS = (
    r";", r"\.(?=\s)", r",\s*and(?:\s+then)?", r",\s*plus", r",", r"\band\s+also", r"\band", r"\bplus", r"&", r"\bwith", r"\bas well as",
    r"\btogether with", r"\balong with", r"\balongside", r"\baccompanied by", r"\bbeside",
    r"\bnext to", r"\bbesides",
)
# Relations that also place the two objects they join: (first anchor, second anchor).
_RELATIONS: tuple[tuple[str, Anchor, Anchor], ...] = (
    (r"\bto the left of", (0.25, 0.5), (0.75, 0.5)),
    (r"\bleft of", (0.25, 0.5), (0.75, 0.5)),
    (r"\bto the right of", (0.75, 0.5), (0.25, 0.5)),
    (r"\bright of", (0.75, 0.5), (0.25, 0.5)),
    (r"\bon top of", (0.5, 0.25), (0.5, 0.75)),
    (r"\babove", (0.5, 0.25), (0.5, 0.75)),
    (r"\bover", (0.5, 0.25), (0.5, 0.75)),
    (r"\bbelow", (0.5, 0.75), (0.5, 0.25)),
    (r"\bunder(?:neath)?", (0.5, 0.75), (0.5, 0.25)),
    (r"\bbeneath", (0.5, 0.75), (0.5, 0.25)),
)
_SIDE = r"(?:top|bottom|upper|lower|left|right|center|centre|middle)"
PLACE_PHRASE = re.compile(
    rf"(?:\b(?:on|at|in|to|near|towards?|along|by)\s+(?:the\s+)?(?:very\s+|far\s+)?"
    rf"{_SIDE}(?:[\s-]+{_SIDE})?(?:\s+(?:side|part|half|corner|edge|area|end|region))?"
    rf"(?:\s+of\s+the\s+(?:image|picture|frame|scene|canvas|photo))?"
    rf"|\bon\s+top\b|\b{_SIDE}[\s-]+(?:left|right)\s+corner\b)",
    re.IGNORECASE,
)
"""A place phrase: "on the left", "to the right side", "at the top", "on top", "in the top
left corner", "near the bottom edge of the image"."""
_FRAMING = re.compile(
    r"^\s*(?:(?:please|kindly|now)\s+|(?:can|could|would|will)\s+you\s+|"
    r"i\s*(?:want|need|would\s+like|'d\s+like)\s+(?:to\s+see\s+|you\s+to\s+)?|"
    r"(?:let'?s|let\s+us)\s+|give\s+me\s+|"
    r"(?:draw|show|generate|make|create|render|paint|put|place|add|produce|depict|"
    rf"illustrate|sketch|design)(?:\s+(?:me|us)\s+|\s*:\s*|\s+(?={_DET}\s))|"
    r"(?:a|an|the)\s+(?:picture|image|photo|photograph|drawing|painting|render|"
    r"illustration|scene)\s+(?:of|with|showing)\s+|there\s+(?:is|are)\s+)+",
    re.IGNORECASE,
)
"""Framing before the objects, any number in a row: "please draw me a picture of", "can you
make", "I want to see", "there is", "put" (a verb only before a determiner or "me": "place
setting" stays)."""
_LEADING_VERB = re.compile(
    r"^\s*(?:draw|show|generate|make|create|render|paint|put|place|add|produce|depict|"
    r"illustrate|sketch|design)\s+(?=\S)",
    re.IGNORECASE,
)
"""A request verb that opens a goal without a determiner after it ("draw red circle and blue
square"): framing only when what follows is an article-free list (`_drop_leading_verb`)."""
_PAREN_PLACE = re.compile(
    rf"\s*\(\s*(?:(?:on|at|in|to)\s+)?(?:the\s+)?({_SIDE}(?:[\s-]+{_SIDE})?)"
    rf"(?:\s+(?:side|part|half|corner|edge|area))?\s*\)",
    re.IGNORECASE,
)
"""A place in brackets after an object: "a red circle (left)", "a blue square (top right)"."""
_LABELLED_PLACE = re.compile(
    rf"(^|[,;&.]|\band\b|\bplus\b)(\s*)(?:the\s+)?({_SIDE}(?:[\s-]+{_SIDE})?)\s*(?::|\s[-–—])\s*"
    r"(.+?)(?=\s*(?:[,;&.]|\band\b|\bplus\b|$))",
    re.IGNORECASE,
)
"""A place written as a label before its object: "left: a red circle, right: a blue square",
"top - a green ring"."""
_TRAILING_SIDE = re.compile(
    rf"(?<!\bthe)(?<!\bon)(?<!\bat)(?<!\bin)(?<!\bto)\s+({_SIDE}(?:[\s-]+{_SIDE})?)\s*$",
    re.IGNORECASE,
)
_LIST_SEPARATOR = re.compile(r"\s*(?:[,;&]|\band\b|\bplus\b)\s*", re.IGNORECASE)
_ARRANGEMENTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r",?\s*\b(?:side\s+by\s+side|next\s+to\s+each\s+other|beside\s+each\s+other|"
                r"next\s+to\s+one\s+another|left\s+and\s+right|(?:all\s+)?in\s+an?\s+"
                r"(?:horizontal\s+)?(?:row|line)|(?:from\s+)?left\s+to\s+right|"
                r"horizontally)\s*[.!]?\s*$", re.IGNORECASE), "row"),
    (re.compile(r",?\s*\b(?:one\s+above\s+the\s+other|stacked(?:\s+vertically)?|"
                r"on\s+top\s+of\s+each\s+other|top\s+and\s+bottom|(?:all\s+)?in\s+an?\s+"
                r"(?:vertical\s+)?(?:column|stack)|in\s+a\s+vertical\s+(?:row|line)|"
                r"(?:from\s+)?top\s+to\s+bottom|vertically)\s*[.!]?\s*$", re.IGNORECASE),
     "column"),
)
"""Phrases closing a goal that arrange its objects ("a cat and a dog side by side", "a cup, a
plate and a bowl in a row": evenly spaced from left to right, in the goal's order;
"stacked", "in a column": from the top down). Read only when none of the objects has a
place of its own (by its words or a relation); otherwise the words stay."""


def arrangement_anchors(axis: str, n: int) -> list[Anchor]:
    """``n`` anchors evenly spaced along a row (left to right) or a column (top down). Two or
    three objects take the anchors of the place words themselves ("left", "center", "right":
    0.25, 0.5, 0.75), so that a region's prompt ("... on the left") says where its region
    is; four or more the centers of n equal bands."""
    along = [0.25 + 0.5 * k / (n - 1) for k in range(n)] if n <= 3 else [(k + 0.5) / n for k in range(n)]
    return [(a, 0.5) for a in along] if axis == "row" else [(0.5, a) for a in along]


_SCENE = re.compile(
    r",?\s*\b(?:on|against|with|over)\s+(?:an?\s+|the\s+)?(?:[\w-]+\s+){0,3}background\b"
    r"|[,;]\s*(?:an?\s+|the\s+)?(?:[\w-]+\s+){0,3}background\s*[.!]?\s*$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Part:
    """One object a goal asks for.

    ``text`` names the part (unique within a goal: the key of its score); ``subject`` is the
    object without its place ("a small red circle"); ``place`` the anchor the goal gives it
    (None: not stated); ``scale`` its size word's region scale (1 without one).
    """

    text: str
    subject: str
    place: Anchor | None = None
    scale: float = 1.0
    stated_place: bool = True
    """Whether ``place`` comes from the goal's words (False: a relation or the planner)."""

    def prompt(self) -> str:
        """What a region draws for this part: its own words when they state its place, else
        its subject with its place in words ("a red circle on the left")."""
        if self.place is None or (self.stated_place and anchor_of(self.text) == self.place):
            return self.text
        return f"{self.subject} {place_words(self.place)}"


class GoalParser(Protocol):
    """Reads a goal text into its parts; deterministic for a given text."""

    name: str

    def parse(self, text: str) -> tuple[Part, ...]:
        """The goal's parts, in the goal's order (one part, or none, for a single object)."""
        ...


def anchor_of(phrase: str) -> Anchor | None:
    """Where a phrase says it is, or None when it names no position.

    Left/right set x, top/upper/bottom/lower set y ("the top left corner" sets both), and
    center/middle keeps the middle. A phrase that names two opposite sides is not placed.
    """
    words = set(re.findall(r"[a-z]+", phrase.lower()))
    xs = {HORIZONTAL[w] for w in words & HORIZONTAL.keys()}
    ys = {VERTICAL[w] for w in words & VERTICAL.keys()}
    if len(xs) > 1 or len(ys) > 1 or not (xs or ys or words & CENTER):
        return None
    return (xs.pop() if xs else 0.5, ys.pop() if ys else 0.5)


def place_words(anchor: Anchor) -> str:
    """A place phrase for an anchor: "on the left", "at the top", "in the top left corner"."""
    x, y = anchor
    h = "left" if x < 0.4 else "right" if x > 0.6 else ""
    v = "top" if y < 0.4 else "bottom" if y > 0.6 else ""
    if h and v:
        return f"in the {v} {h} corner"
    if h:
        return f"on the {h}"
    if v:
        return f"at the {v}"
    return "in the center"


def _singular(word: str) -> str:
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "ches", "shes", "zes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")) and len(word) > 2:
        return word[:-1]
    return word


def _starts_object(segment: str) -> bool:
    """Whether a segment opens a noun phrase (a determiner or a number first)."""
    return re.match(rf"^\s*{_DET}\b", segment, re.IGNORECASE) is not None


def _is_place_only(segment: str) -> bool:
    """A segment that is a place phrase and nothing else ("on the left")."""
    return bool(segment.strip()) and not PLACE_PHRASE.sub("", segment).strip(" ,.")


_NOT_FRAME = r"(?!\s*the\s+(?:image|picture|frame|scene|canvas|photo)\b)"


def _split_segments(text: str) -> list[tuple[str, str, tuple[Anchor, Anchor] | None]]:
    """Split at joining words and relations that a noun phrase (or a place phrase) follows.
    Each segment comes with the word that joined it to the previous one ("" for the first)
    and that word's places if it is a relation ("above": first on top, second below)."""
    pattern = "|".join(
        [f"(?P<j{i}>{j})" for i, j in enumerate(_JOINERS)]
        + [f"(?P<r{i}>{r})" for i, (r, _, _) in enumerate(_RELATIONS)]
    )
    follows = rf"{_NOT_FRAME}(?=\s*(?:{_DET}\b|{PLACE_PHRASE.pattern}))"
    out: list[tuple[str, str, tuple[Anchor, Anchor] | None]] = []
    start, joiner, relation = 0, "", None
    for m in re.finditer(rf"(?<!\bthe\s)(?:{pattern}){follows}", text, re.IGNORECASE):
        if m.start() == 0:
            continue
        kind = m.lastgroup or ""
        out.append((text[start:m.start()], joiner, relation))
        start, joiner = m.end(), m.group(0).strip().lower()
        relation = _RELATIONS[int(kind[1:])][1:] if kind.startswith("r") else None
    out.append((text[start:], joiner, relation))
    return out


_BARE_JOINER = re.compile(r"\s*(?:;|&|\band\s+also\b|\band\b|\bplus\b)\s*", re.IGNORECASE)
"""Joining words between noun phrases written without determiners ("red circle and blue
square", "cat & dog house"). Commas split such a list only before its last joining word
("red circle, blue square and green triangle"): after it, or in a list with none, they
usually add modifiers ("red circle and blue square, highly detailed")."""

BARE_MIN_WORDS = 2
"""Words (besides determiners and place phrases) each phrase of an article-free list needs
before the list is split: "red circle and blue square" is two objects, "a black and white
cat" and "salt and pepper" stay one."""


COLOR_WORDS = frozenset(
    "red orange yellow green cyan blue purple pink white black gray grey brown violet magenta "
    "teal navy beige gold golden silver turquoise maroon crimson scarlet indigo".split()
)
"""Colors: a phrase of an article-free list that ends in one names no object yet ("dark blue
and light green stripes" is one part, striped in two colors)."""


def _content_words(phrase: str) -> list[str]:
    words = re.findall(r"[a-z0-9'-]+", PLACE_PHRASE.sub(" ", phrase).lower())
    return [w for w in words if w not in DETERMINERS]


def _bare_pieces(segment: str) -> list[str]:
    """An article-free list's noun phrases (the segment alone when it is not one)."""
    joiners = list(_BARE_JOINER.finditer(segment))
    if not joiners:
        # a list by commas (or sentences) alone is a list when each phrase states its own
        # place ("red circle on the left, blue square on the right", "left: red circle.
        # right: blue square.")
        pieces = [p for p in re.split(r"\s*(?:,|\.(?=\s))\s*", segment) if p.strip(" ,.;")]
        if len(pieces) > 1 and all(
            PLACE_PHRASE.search(p) and len(_content_words(p)) >= BARE_MIN_WORDS for p in pieces
        ):
            return pieces
        return [segment]
    last = joiners[-1]
    head = re.split(r"\s*,\s*", segment[: last.start()])
    pieces = [q for h in head for q in _BARE_JOINER.split(h)] + [segment[last.end():]]
    pieces = [p for p in pieces if p.strip(" ,.;")]
    words = [_content_words(p) for p in pieces]
    if (
        len(pieces) > 1
        and all(len(w) >= BARE_MIN_WORDS for w in words)
        and not any(w[-1] in COLOR_WORDS for w in words[:-1])
    ):
        return pieces
    return [segment]


def _split_bare(
    segments: list[tuple[str, str, tuple[Anchor, Anchor] | None]],
) -> list[tuple[str, str, tuple[Anchor, Anchor] | None, bool]]:
    """Each segment, with whether it opens a new object; an article-free list of noun
    phrases ("red circle and blue square") becomes one segment per phrase, each after the
    first opening an object (`_bare_pieces`)."""
    out: list[tuple[str, str, tuple[Anchor, Anchor] | None, bool]] = []
    for segment, joiner, relation in segments:
        first, *rest = _bare_pieces(segment)
        out.append((first, joiner, relation, False))
        out.extend((p, "and", None, True) for p in rest)
    return out


def _drop_leading_verb(body: str) -> str:
    """The body without its opening request verb when the rest is an article-free list
    ("draw red circle and blue square"); "place setting with a red plate" and "paint
    splatter" keep their first word, since the rest alone is no list."""
    m = _LEADING_VERB.match(body)
    if m is None:
        return body
    rest = body[m.end():]
    first = _split_segments(rest)[0][0]
    return rest if len(_bare_pieces(first)) > 1 else body


def _bracketed_places(text: str) -> str:
    """Bracketed places as place phrases: "a red circle (left)" -> "a red circle on the left"."""

    def words(m: re.Match[str]) -> str:
        side = re.sub(r"[\s-]+", " ", m.group(1).lower())
        corner = " corner" if len(side.split()) == 2 and side.split()[1] in ("left", "right") else ""
        return f" on the {side}{corner}"

    return _PAREN_PLACE.sub(words, text)


def _places_in_words(body: str) -> str:
    """Places written without a preposition, as place phrases: labels ("left: a red circle,
    right: a blue square") and side words after every object of a list ("red circle left,
    blue square right"; only when every object of the list ends with one, so "a red spinning
    top and a blue ball" keeps its top)."""
    body = _LABELLED_PLACE.sub(
        lambda m: f"{m.group(1)}{m.group(2)}{m.group(4).strip()} on the {m.group(3)}", body
    )
    pieces = _LIST_SEPARATOR.split(body)
    ends = [_TRAILING_SIDE.search(p) for p in pieces]
    if len(pieces) < 2 or not all(ends) or any(
        len(_content_words(p[: e.start()])) < 1 for p, e in zip(pieces, ends, strict=True) if e
    ):
        return body
    out, last = [], 0
    for sep in [*_LIST_SEPARATOR.finditer(body), None]:
        end = sep.start() if sep else len(body)
        piece = body[last:end]
        m = _TRAILING_SIDE.search(piece)
        out.append(f"{piece[: m.start()]} on the {m.group(1)}" if m else piece)
        out.append(sep.group(0) if sep else "")
        last = sep.end() if sep else end
    return "".join(out)


_ITEM_SPLIT = re.compile(r"\s*(?:,\s*and\b|,|\band\b|&)\s*", re.IGNORECASE)


def _distributed(body: str) -> str:
    """A count whose objects are then told apart, as one phrase per object: "two circles, one
    red and one blue" -> "a red circle and a blue circle"; "three circles in a row: red,
    green and blue" -> "a red circle, a green circle and a blue circle in a row"; "two
    squares: one on the left, one on the right". Only when the items are as many as the
    count, each of at most four words without an article, and after a comma each opening
    with "one" ("two circles, highly detailed and sharp" keeps its modifiers); otherwise the
    body is unchanged."""
    whole, closing = _arrangement(body)
    m = re.match(r"^(?P<left>[^:,]+?)\s*(?P<sep>[:,])\s*(?P<items>.+?)\s*[.!]?\s*$", whole)
    if m is None:
        return body
    left, axis = _arrangement(m.group("left"))
    n, one = _count_of(left)
    raw = [i.strip() for i in _ITEM_SPLIT.split(m.group("items")) if i.strip()]
    items = [re.sub(r"^one\s+", "", i, flags=re.IGNORECASE) for i in raw]
    if n < 2 or len(items) != n or any(
        not i or len(i.split()) > 4 or re.match(rf"^{_DET}\b", i, re.IGNORECASE) for i in items
    ) or (m.group("sep") == "," and not all(re.match(r"^one\s", i, re.IGNORECASE) for i in raw)):
        return body
    axis = axis or closing
    noun = re.sub(r"^an?\s+", "", one)
    phrases = []
    for item in items:
        if item.split()[0].lower() in _PREPOSITIONS:  # a place after the noun
            phrases.append(f"{one} {item}")
        else:  # modifiers before it
            phrases.append(f"{'an' if item[:1].lower() in 'aeiou' else 'a'} {item} {noun}")
    arranged = {"row": " in a row", "column": " in a column"}.get(axis or "", "")
    return f"{', '.join(phrases[:-1])} and {phrases[-1]}{arranged}"


def _arrangement(body: str) -> tuple[str, str | None]:
    """The body without a closing phrase that arranges its objects ("side by side", "in a
    row", "stacked"), and the arrangement's axis ("row", "column"; None without one)."""
    for pattern, axis in _ARRANGEMENTS:
        if pattern.search(body):
            return _tidy(pattern.sub("", body)), axis
    return body, None


def _count_of(phrase: str) -> tuple[int, str]:
    """(n, the phrase for one of them) for "two red circles"; (1, phrase) otherwise."""
    m = re.match(r"^\s*(a pair of|a couple of|[a-z0-9]+)\s+(.*)$", phrase, re.IGNORECASE)
    if not m or m.group(1).lower() not in NUMBERS or m.group(1).lower() in ("a", "an"):
        return 1, phrase
    n, rest = NUMBERS[m.group(1).lower()], m.group(2)
    words = rest.split()
    # the noun: the last word before a preposition, or the word a comma closes ("two
    # circles, highly detailed")
    cut = next((i + w.endswith(",") for i, w in enumerate(words)
                if w.lower() in _PREPOSITIONS or w.endswith(",")), len(words))
    if cut == 0:
        return 1, phrase
    noun = words[cut - 1]
    words[cut - 1] = _singular(noun[:-1]) + "," if noun.endswith(",") else _singular(noun)
    head = " ".join(words)
    return n, f"{'an' if head[:1].lower() in 'aeiou' else 'a'} {head}"


_PREPOSITIONS = frozenset("on in at to of with behind beside under above near below over by".split())


def _scale_of(phrase: str) -> float:
    words = re.findall(r"[a-z]+", phrase.lower())
    scales = [SIZE_SCALES[w] for w in words if w in SIZE_SCALES]
    return scales[0] if scales else 1.0


def _tidy(phrase: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"\s+,", ",", phrase)).strip(" ,.;?!")


class RuleParser:
    """The default parser: joining words, determiners, numbers and place phrases.

    Splits at "and", commas, "with", "plus", "next to", "alongside", "as well as", "together
    with", … when a noun phrase (a determiner or number) or a place phrase follows, and an
    article-free list ("red circle & blue square", "red circle, blue square and green
    triangle") when each of its phrases has two words or more (`_bare_pieces`); glues
    modifier segments back on ("a red circle, small", "on the left, a red circle"); drops
    framing ("a picture of", "there is") and a background clause; reads relations ("a circle
    above a square", "to the left of") and arrangements ("in a row", "stacked") as places;
    expands counts ("two red circles", "two circles, one red and one blue") into one part
    each, at most `MAX_PARTS` in all.
    """

    name = "rules"

    def parse(self, text: str) -> tuple[Part, ...]:
        body = _SCENE.sub("", _FRAMING.sub("", _bracketed_places(text.strip())))
        body = _distributed(_places_in_words(_drop_leading_verb(body)))
        rest, axis = _arrangement(body)
        if axis is not None:
            parts = self._parts(*self._objects(rest))
            if len(parts) > 1 and all(p.place is None for p in parts):
                anchors = arrangement_anchors(axis, len(parts))
                return tuple(replace(p, place=a, stated_place=False)
                             for p, a in zip(parts, anchors, strict=True))
        return self._parts(*self._objects(body))  # the phrase arranges nothing: keep its words

    def _objects(self, body: str) -> tuple[list[list[str]], list[Anchor | None]]:
        """Each object's segments, and the place a relation gives it."""
        objects: list[list[str]] = []  # each object's segments
        places: list[Anchor | None] = []  # a relation's place per object
        pending: list[str] = []  # place-only segments waiting for their object
        segments = _split_bare(_split_segments(body))
        for k, (segment, joiner, relation, opens) in enumerate(segments):
            segment = _FRAMING.sub("", segment)
            if not segment.strip(" ,.;"):
                continue
            if relation is not None and objects:
                places[-1] = places[-1] or relation[0]
            if _is_place_only(segment) and relation is None:
                # "on the left, a red circle": the place opens the next object's phrase unless
                # it trails an object that has none yet ("a red circle that is small, on the left")
                opens_next = k + 1 < len(segments) and _starts_object(segments[k + 1][0])
                trails = objects and anchor_of(" ".join(objects[-1])) is None and not pending
                if opens_next and (not trails or joiner not in (",", "")):
                    pending.append(segment)
                elif objects:
                    objects[-1].append(segment)
                else:
                    pending.append(segment)
            elif opens or _starts_object(segment) or not objects:
                objects.append([*pending, segment])
                places.append(relation[1] if relation else None)
                pending = []
            else:
                objects[-1].append(segment)
        if pending and objects:
            objects[-1].extend(pending)
        return objects, places

    def _parts(self, objects: list[list[str]], places: list[Anchor | None]) -> tuple[Part, ...]:
        parts: list[Part] = []
        for segments, relation_place in zip(objects, places, strict=True):
            phrase = _tidy(", ".join(_tidy(s) for s in segments))
            if not phrase:
                continue
            stated = anchor_of(" ".join(PLACE_PHRASE.findall(phrase)))
            subject = _tidy(PLACE_PHRASE.sub("", phrase)) or phrase
            n, one = _count_of(subject)
            place = stated or relation_place
            if n == 1:
                parts.append(Part(phrase, subject, place, _scale_of(phrase), stated is not None))
                continue
            for k in range(n):
                key = f"{one} ({k + 1} of {n})"
                parts.append(Part(key, one, None, _scale_of(phrase), False))
        if len(parts) > MAX_PARTS:
            return ()
        return _unique(parts) if len(parts) > 1 else tuple(parts)


def _unique(parts: list[Part]) -> tuple[Part, ...]:
    """Parts with distinct texts (a repeated phrase gets "(2)", "(3)"...)."""
    seen: dict[str, int] = {}
    out = []
    for p in parts:
        seen[p.text] = seen.get(p.text, 0) + 1
        out.append(p if seen[p.text] == 1 else replace(p, text=f"{p.text} ({seen[p.text]})"))
    return tuple(out)


PARSERS: dict[str, GoalParser] = {"rules": RuleParser()}
"""Registered goal parsers by name; `register_parser` adds one."""


def register_parser(parser: GoalParser) -> None:
    """Make ``parser`` available under ``parser.name`` (replacing one of that name)."""
    PARSERS[parser.name] = parser
    goal_parts.cache_clear()


def get_parser(name: str) -> GoalParser:
    """The registered parser called ``name``."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown goal parser {name!r}; known: {sorted(PARSERS)}") from None


@lru_cache(maxsize=4096)
def goal_parts(text: str, parser: str = "rules") -> tuple[Part, ...]:
    """The parts of a goal of several objects (empty for one object or none), by ``parser``."""
    parts = get_parser(parser).parse(text)
    return parts if len(parts) > 1 else ()


def parts_of(
    goal: str, stored: tuple[dict, ...] | None = None, parser: str = "rules"
) -> tuple[Part, ...]:
    """A goal's parts: those stored with it (given by the caller, or parsed once when it was
    created, see `agentloop.parse_llm`), else ``parser``'s parse of its text. A parser that
    reads goals only at creation ("llm") falls back to the rules here: its goals carry their
    parts, and one whose parse failed was left to the rules."""
    if stored is not None:
        return tuple(part_from_json(d) for d in stored)
    return goal_parts(goal, parser if parser in PARSERS else "rules")


def part_to_json(part: Part) -> dict:
    """A part as stored in a goal's spec: text, subject, place ([x, y] or null), scale."""
    return {"text": part.text, "subject": part.subject,
            "place": list(part.place) if part.place is not None else None,
            "scale": part.scale, "stated_place": part.stated_place}


def part_from_json(data: dict) -> Part:
    """The part a `part_to_json` dict (or a caller's part) describes; a missing subject is
    the text without its place phrase."""
    text = str(data["text"])
    place = data.get("place")
    subject = data.get("subject") or _tidy(PLACE_PHRASE.sub("", text)) or text
    return Part(text, str(subject), (float(place[0]), float(place[1])) if place else None,
                float(data.get("scale", 1.0)), bool(data.get("stated_place", place is not None)))


def part_texts(text: str, parser: str = "rules") -> tuple[str, ...]:
    """The texts of a goal's parts: the keys of its part scores."""
    return tuple(p.text for p in goal_parts(text, parser))


def part_regions(
    parts: tuple[Part, ...], layout: tuple[tuple, ...] = ()
) -> tuple[tuple[str, float, float, float] | None, ...]:
    """Where each part should be in a candidate's image, for judging it there: (prompt, x,
    y, scale) per part, or None to judge it on the whole image; () when no part has a place.

    A candidate drawn from a layout of one region per part is judged region by region (the
    layout's prompts, in the parts' order); any other candidate where the goal places its
    parts (by words or relations), the rest on the whole image."""
    if not parts:
        return ()
    if layout and len(layout) == len(parts):
        out = []
        for entry in layout:
            prompt, x, y, *rest = entry
            out.append((str(prompt), float(x), float(y), float(rest[0]) if rest else 1.0))
        return tuple(out)
    placed = tuple(
        (p.text, p.place[0], p.place[1], p.scale) if p.place is not None else None for p in parts
    )
    return placed if any(r is not None for r in placed) else ()


_FUNCTION_WORDS = frozenset(
    {*(d for d in DETERMINERS if " " not in d), *_PREPOSITIONS, "and", "or", "that", "is", "are",
     "which", "who", "very"}
)


def _head_phrase(subject: str) -> tuple[list[str], int] | None:
    """The words of a subject's head noun phrase and the index of its noun: the words before
    the first comma or preposition, the noun last ("a small red circle, colored" → noun
    "circle", modifiers "small", "red"). None when no content word is left."""
    head = re.split(r",", subject, maxsplit=1)[0]
    words = head.split()
    cut = next((i for i, w in enumerate(words) if i and w.lower() in _PREPOSITIONS), len(words))
    words = words[:cut]
    content = [i for i, w in enumerate(words) if w.lower() not in _FUNCTION_WORDS]
    if not content:
        return None
    return words, content[-1]


def _modifiers(words: list[str], noun: int) -> list[int]:
    """Indices of the content words before the noun, nearest the noun first."""
    return [i for i in range(noun - 1, -1, -1) if words[i].lower() not in _FUNCTION_WORDS]


def contrast_subjects(subject: str, others: list[str]) -> list[str]:
    """Hard negatives for one part, made of the goal's own words: the part's subject with the
    attributes of the goal's other parts bound wrongly. For each other part: its noun with
    this part's modifiers ("a small red ring" for "a small red circle" beside "a large blue
    ring"), this part's noun with each of the other's modifiers in turn, aligned from the noun
    ("a small blue circle", "a large red circle"), this noun with all of the other's modifiers
    ("a large blue circle"), and the other part's own subject. No vocabulary: any words in the
    usual adjective-noun order work; a subject without a noun phrase gets none."""
    mine = _head_phrase(subject)
    if mine is None:
        return []
    words, noun = mine
    rest = subject[len(re.split(r",", subject, maxsplit=1)[0]):]
    tail = " ".join(subject.split(",", 1)[0].split()[len(words):])
    suffix = (f" {tail}" if tail else "") + rest

    def text(ws: list[str]) -> str:
        return _tidy(" ".join(ws) + suffix)

    out: list[str] = []
    mods = _modifiers(words, noun)
    for other in others:
        theirs = _head_phrase(other)
        if theirs is None:
            continue
        t_words, t_noun = theirs
        t_mods = _modifiers(t_words, t_noun)
        if t_words[t_noun].lower() != words[noun].lower():
            out.append(text([*words[:noun], t_words[t_noun], *words[noun + 1:]]))
        swapped = list(words)
        for i, j in zip(mods, t_mods, strict=False):
            if words[i].lower() != t_words[j].lower():
                one = list(words)
                one[i] = t_words[j]
                out.append(text(one))
                swapped[i] = t_words[j]
        out.append(text(swapped))
        out.append(_tidy(other))
    own = _tidy(subject).lower()
    seen: set[str] = set()
    return [t for t in out if t.lower() != own and not (t.lower() in seen or seen.add(t.lower()))]


def part_contrasts(parts: tuple[Part, ...], judged: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """For each part, the texts its view is checked against besides its own ``judged`` text
    (the region prompt its score is taken on): `contrast_subjects` put in place of the part's
    subject in that text, so place words stay the same and only the binding differs."""
    out = []
    for k, (part, text) in enumerate(zip(parts, judged, strict=True)):
        others = [p.subject for i, p in enumerate(parts) if i != k]
        negatives = contrast_subjects(part.subject, others)
        if part.subject in text:
            out.append(tuple(text.replace(part.subject, n, 1) for n in negatives))
        else:
            out.append(tuple(negatives))
    return tuple(out)
