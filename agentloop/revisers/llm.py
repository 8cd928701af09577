"""The `llm` reviser: a language model behind an OpenAI-compatible endpoint writes the moves.

Each iteration the model reads the goal, its parts, and the best and worst candidates so far
with their scores (whole goal and per part), layouts and edits, and answers JSON that follows
`ANSWER_SCHEMA`: a list of moves, each a new prompt, a layout, a refinement of a candidate, or
a repair of one. The answer is validated field by field (`Answer`); the moves become drafts
(`moves_to_drafts`), mapped to the nearest move this engine can draw where it cannot draw one
(a repair becomes a refinement, a layout for a model without layouts a plain prompt), and
deduplicated against the history. A bad, late, refused or failing answer, after the attempts
`LlmConfig` allows, hands the iteration to the `search` reviser, and the notes say why.

Given the same answers, the drafts are the same: seeds the model leaves to us ("new") are
derived from the goal's seed, the iteration and the move's place with `derive_seed`.
"""

from __future__ import annotations

import json
import threading
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from agentloop.domain import (
    MAX_PROMPT_CHARS,
    MAX_SEED,
    CandidateDraft,
    CandidateView,
    Layout,
    SafeStr,
)
from agentloop.layout import MAX_REGIONS
from agentloop.llm import ChatClient, ChatFailed, LlmConfig
from agentloop.revisers.base import Proposal, ReviserContext, derive_seed, objective
from agentloop.revisers.search import (
    Identity,
    SearchReviser,
    _draws_layouts,
    _identity,
    _identity_of,
)

MAX_MOVES = 64
"""Most moves one answer may hold (an iteration uses at most `n` of them)."""
MAX_WHY_CHARS = 500
MAX_RATIONALE_CHARS = 2000
SHOWN_BEST = 6
"""How many of the best candidates the model sees."""
SHOWN_WORST = 3
"""How many of the worst candidates the model sees (what to avoid)."""
SEED_SALT = 3000
"""Salt of the seeds derived for moves that ask for a new seed (apart from search's)."""

def _has_words(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be only white space")
    return v


Text = Annotated[SafeStr, Field(min_length=1, max_length=MAX_PROMPT_CHARS), AfterValidator(_has_words)]
"""A prompt: storable (no NUL, no lone surrogate), 1 to 2000 characters, not only spaces."""
Note = Annotated[SafeStr, Field(max_length=MAX_WHY_CHARS)]
Unit = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
SeedChoice = Annotated[int, Field(ge=0, le=MAX_SEED)] | Literal["new", "parent"] | None


class RegionMove(BaseModel):
    """One region of a layout: `prompt` draws the area nearest the anchor (x, y)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Text
    x: Unit
    y: Unit

    @field_validator("x", "y", mode="before")
    @classmethod
    def _int_is_float(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


class RepairArea(BaseModel):
    """The part of a candidate's image a repair redraws: a box in [0, 1] from the top-left."""

    model_config = ConfigDict(extra="forbid", strict=True)

    x: Unit
    y: Unit
    w: Unit
    h: Unit

    @field_validator("x", "y", "w", "h", mode="before")
    @classmethod
    def _int_is_float(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _inside(self) -> RepairArea:
        if self.w <= 0 or self.h <= 0 or self.x + self.w > 1 + 1e-9 or self.y + self.h > 1 + 1e-9:
            raise ValueError("the box must have a positive size and lie inside the image")
        return self

    @property
    def center(self) -> tuple[float, float]:
        return (self.x + self.w / 2, self.y + self.h / 2)


class Move(BaseModel):
    """One move of an answer; which fields it needs depends on `kind` (see ANSWER_SCHEMA)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Literal["prompt", "layout", "refine", "repair"]
    parent_id: str | None = None
    prompt: Text | None = None
    negative_prompt: Annotated[SafeStr, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    seed: SeedChoice = None
    regions: Annotated[list[RegionMove], Field(min_length=1, max_length=MAX_REGIONS)] | None = None
    variation_strength: Unit | None = None
    area: RepairArea | None = None
    strength: Unit | None = None
    why: Note | None = None

    @field_validator("variation_strength", "strength", mode="before")
    @classmethod
    def _int_is_float(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _fields_of_kind(self, info: ValidationInfo) -> Move:
        ids: set[str] = (info.context or {}).get("ids", set())
        k = self.kind
        if self.parent_id is not None and self.parent_id not in ids:
            raise ValueError(f"parent_id {self.parent_id!r} is not the id of a scored candidate")
        if k in ("refine", "repair") and self.parent_id is None:
            raise ValueError(f"a {k} move needs the parent_id of a scored candidate")
        if self.seed == "parent" and self.parent_id is None:
            raise ValueError('seed "parent" needs a parent_id')
        if k == "prompt" and not self.prompt:
            raise ValueError("a prompt move needs a prompt")
        if k == "layout" and not self.regions:
            raise ValueError("a layout move needs regions")
        if k == "repair" and not self.prompt:
            raise ValueError("a repair move needs a prompt: what the repaired area should show")
        if k in ("prompt", "repair") and self.regions is not None:
            raise ValueError("regions belong to layout and refine moves")
        if k != "repair" and (self.area is not None or self.strength is not None):
            raise ValueError("area and strength belong to repair moves")
        if k == "refine" and not (self.prompt or self.regions or self.variation_strength
                                  or self.seed not in (None, "parent")):
            raise ValueError("a refine move must change something: prompt, regions, "
                             "variation_strength or seed")
        return self


class Answer(BaseModel):
    """The model's whole answer."""

    model_config = ConfigDict(extra="forbid", strict=True)

    rationale: Annotated[SafeStr, Field(max_length=MAX_RATIONALE_CHARS)] | None = None
    moves: Annotated[list[Move], Field(min_length=1, max_length=MAX_MOVES)]


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_UNIT = {"type": "number", "minimum": 0, "maximum": 1}
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["rationale", "moves"],
    "properties": {
        "rationale": _nullable({"type": "string", "maxLength": MAX_RATIONALE_CHARS}),
        "moves": {
            "type": "array", "minItems": 1, "maxItems": MAX_MOVES,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["kind", "parent_id", "prompt", "negative_prompt", "seed", "regions",
                             "variation_strength", "area", "strength", "why"],
                "properties": {
                    "kind": {"type": "string", "enum": ["prompt", "layout", "refine", "repair"]},
                    "parent_id": _nullable({"type": "string"}),
                    "prompt": _nullable({"type": "string", "minLength": 1,
                                         "maxLength": MAX_PROMPT_CHARS}),
                    "negative_prompt": _nullable({"type": "string", "maxLength": MAX_PROMPT_CHARS}),
                    "seed": {"anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
                        {"type": "string", "enum": ["new", "parent"]},
                        {"type": "null"},
                    ]},
                    "regions": _nullable({
                        "type": "array", "minItems": 1, "maxItems": MAX_REGIONS,
                        "items": {
                            "type": "object", "additionalProperties": False,
                            "required": ["prompt", "x", "y"],
                            "properties": {
                                "prompt": {"type": "string", "minLength": 1,
                                           "maxLength": MAX_PROMPT_CHARS},
                                "x": _UNIT, "y": _UNIT,
                            },
                        },
                    }),
                    "variation_strength": _nullable(_UNIT),
                    "area": _nullable({
                        "type": "object", "additionalProperties": False,
                        "required": ["x", "y", "w", "h"],
                        "properties": {"x": _UNIT, "y": _UNIT, "w": _UNIT, "h": _UNIT},
                    }),
                    "strength": _nullable(_UNIT),
                    "why": _nullable({"type": "string", "maxLength": MAX_WHY_CHARS}),
                },
            },
        },
    },
}
"""The JSON schema of an answer (docs/revisers.md explains each field). Every property is
listed as required and nullable, so that servers that enforce schemas strictly (OpenAI's
`strict`) take it; the parser also accepts an answer that leaves optional fields out."""

SYSTEM_PROMPT = """\
You steer an image generation loop. A text-to-image model draws candidates; a CLIP scorer \
rates each against the goal on the CLIPScore scale (2.5 * max(cosine, 0); higher is better; \
well-matched images of this model score about 0.7 to 1.0). A goal with several parts also gets \
a score per part; candidates are ranked by the mean of the whole-goal score and every part's \
score (objective), so an image that drops a part loses.

You read the situation as JSON: the goal, its parts (and part_places, the anchors the goal gives them, when it does), layouts_supported, n (how many moves to give), and the best and worst candidates so far with their id, prompt, seed, score, objective (what ranks them), part_scores, regions, parent_id and edit. Propose the next candidates as moves:
- "prompt": a new prompt (fields: prompt, optional negative_prompt, seed).
- "layout": each part drawn in its own region (fields: regions = [{prompt, x, y}] with the \
anchor x, y in [0, 1] from the top-left corner, optional prompt for the whole image, seed). \
Only when layouts_supported is true.
- "refine": change a scored candidate (parent_id) a little: a new prompt and/or regions \
keeping its seed, or a noise variation (variation_strength in (0, 1], small values stay close), \
or another seed.
- "repair": redraw part of a scored candidate (parent_id): prompt says what the area should \
show, area = {x, y, w, h} in [0, 1], strength in (0, 1].
seed: an integer, "new" for a fresh seed, or "parent" for the parent's seed (the default for \
refine and repair; "new" for the others). The same prompt with another seed is a different \
image; reseeding the best prompts is often worth some of the moves.

Answer with one JSON object and nothing else: {"rationale": "...", "moves": [...]} with exactly \
`n` moves (more are cut, fewer are filled by a local search). Every parent_id must be an id \
from the history shown. Keep prompts short and concrete (the text encoder reads about 60 \
words). Put a short reason for each move in its "why"."""


class LlmReviser:
    """Asks a language model for each iteration's moves; falls back to `search` on failure.

    Built with no config (no endpoint configured in this process), every iteration falls back,
    and the notes say so: a goal that chose `llm` still runs.
    """

    name = "llm"
    remote = True
    """It asks a service over the network: the orchestrator consults it outside the goal's
    lock (see `agentloop.orchestrator.advance`)."""

    def __init__(self, config: LlmConfig | None, fallback: SearchReviser | None = None,
                 client: ChatClient | None = None):
        self.config = config
        self.fallback = fallback or SearchReviser()
        self._client = client
        self._lock = threading.Lock()

    def client(self) -> ChatClient:
        assert self.config is not None
        with self._lock:
            if self._client is None:
                self._client = ChatClient(self.config)
            return self._client

    def propose(self, ctx: ReviserContext) -> Proposal:
        if self.config is None:
            return self._fall_back(ctx, "no LLM endpoint is configured in this process "
                                   "(AGENTLOOP_LLM_BASE_URL, AGENTLOOP_LLM_MODEL)", None)
        ids = {c.id for c in ctx.scored()}
        try:
            answer = self.client().ask_json(
                messages(ctx), ANSWER_SCHEMA, "agentloop_moves",
                lambda data: Answer.model_validate(data, context={"ids": ids}),
                seed=derive_seed(ctx.spec.seed, ctx.iteration, 0, salt=SEED_SALT - 1),
            )
        except ChatFailed as exc:
            return self._fall_back(ctx, exc.reason, exc.usage.notes())
        llm_notes = answer.usage.notes() | {"fallback": None}
        try:
            drafts, moves_notes = moves_to_drafts(ctx, answer.value)
        except Exception as exc:  # noqa: BLE001 - a goal never fails because of its model
            return self._fall_back(ctx, f"the moves could not be drawn: {type(exc).__name__}: "
                                   f"{exc}", llm_notes)
        notes: dict[str, Any] = {
            "strategy": "llm", "llm": llm_notes, "rationale": answer.value.rationale,
            **moves_notes,
        }
        if not drafts:
            return self._fall_back(ctx, "no move of the answer could be drawn", llm_notes,
                                   moves_notes)
        if len(drafts) < ctx.n:  # fill the rest with the local search's proposals
            used = {_identity_of(c) for c in ctx.history} | {_draft_identity(d) for d in drafts}
            extra = [d for d in self.fallback.propose(ctx).candidates
                     if _draft_identity(d) not in used][: ctx.n - len(drafts)]
            notes["filled_by_search"] = len(extra)
            drafts += extra
        return Proposal(drafts, notes)

    def _fall_back(self, ctx: ReviserContext, reason: str, llm_notes: dict[str, Any] | None,
                   extra: dict[str, Any] | None = None) -> Proposal:
        proposal = self.fallback.propose(ctx)
        llm = (llm_notes or {"model": self.config.model if self.config else None}) | {
            "fallback": reason}
        notes = proposal.notes | {"reviser": "llm", "llm": llm} | (extra or {})
        return Proposal(proposal.candidates, notes)


def messages(ctx: ReviserContext) -> list[dict[str, str]]:
    """The conversation sent: the rules, then the situation as JSON."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": json.dumps(situation(ctx), ensure_ascii=False)},
    ]


def situation(ctx: ReviserContext) -> dict[str, Any]:
    """What the model reads: the goal, the parts, the best and worst candidates so far."""
    ranked = ctx.scored()
    best = ranked[:SHOWN_BEST]
    worst = [c for c in ranked[SHOWN_BEST:][-SHOWN_WORST:]]
    failed = sum(1 for c in ctx.history if c.status.value == "failed")
    places = {p.text: list(p.place) for p in getattr(ctx, "goal_parts", ()) if p.place}
    return {
        "goal": ctx.spec.goal,
        "parts": list(ctx.parts),
        **({"part_places": places} if places else {}),
        "negative_prompt": ctx.spec.negative_prompt,
        "model": ctx.spec.model,
        "layouts_supported": _draws_layouts(ctx.spec.model),
        "repairs_supported": False,
        "iteration": ctx.iteration,
        "n": ctx.n,
        "candidates_scored": len(ranked),
        "candidates_failed": failed,
        "best": [_shown(c, ctx) for c in best],
        "worst": [_shown(c, ctx) for c in reversed(worst)],
    }


def _shown(c: CandidateView, ctx: ReviserContext) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": c.id, "iteration": c.iteration, "prompt": c.prompt, "seed": c.seed,
        "score": round(c.clip_score or 0.0, 4),
        "objective": round(objective(c, ctx.parts), 4),
    }
    if c.part_scores:
        out["part_scores"] = {p: round(v, 4) for p, v in c.part_scores.items()}
    if c.negative_prompt:
        out["negative_prompt"] = c.negative_prompt
    if c.regions:  # entries are (prompt, x, y), with a fourth value (a scale) where there is one
        out["regions"] = [{"prompt": r[0], "x": r[1], "y": r[2]} for r in c.regions]
    if c.variation_seed is not None:
        out["variation_strength"] = c.variation_strength
    if c.parent_id:
        out["parent_id"] = c.parent_id
    if c.edit:
        out["edit"] = c.edit
    return out


def moves_to_drafts(ctx: ReviserContext, answer: Answer) -> tuple[list[CandidateDraft], dict[str, Any]]:
    """The drafts an answer's moves make, at most `ctx.n`, and notes on each move: what it
    became (`moves`), which were mapped to another kind (`mapped`) or dropped (`dropped`)."""
    by_id = {c.id: c for c in ctx.history}
    layouts = _draws_layouts(ctx.spec.model)
    used: set[Identity] = {_identity_of(c) for c in ctx.history}
    drafts: list[CandidateDraft] = []
    moves: list[dict[str, Any]] = []
    mapped: list[str] = []
    dropped: list[str] = []
    for i, move in enumerate(answer.moves):
        if len(drafts) >= ctx.n:
            dropped.append(f"move {i}: beyond the {ctx.n} candidates of this iteration")
            continue
        parent = by_id.get(move.parent_id) if move.parent_id else None
        kind = move.kind
        if kind == "repair":  # this engine draws whole images only: redraw with the parent's noise
            mapped.append(f"move {i}: repair → refine (the engine draws no repairs; the parent's "
                          "seed is kept and the prompt changed)")
            kind = "refine"
        prompt, regions = _template(ctx, move, parent)
        if regions and not layouts:
            mapped.append(f"move {i}: {move.kind} → prompt (model {ctx.spec.model} draws no "
                          "layouts; the regions' prompts joined)")
            prompt = move.prompt or " and ".join(r[0] for r in regions)
            regions = ()
        seed, variation_seed, strength = _noise(ctx, move, kind, parent, len(drafts))
        negative = move.negative_prompt if move.negative_prompt is not None else (
            parent.negative_prompt if parent else ctx.spec.negative_prompt)
        identity = _identity(prompt, seed, variation_seed, strength, regions)
        salt = 0
        while identity in used:  # the same image again: another seed draws something new
            if kind == "refine" and move.seed in (None, "parent") and salt == 0:
                mapped.append(f"move {i}: repeats a candidate; given a new seed")
            seed = derive_seed(ctx.spec.seed, ctx.iteration, len(drafts), SEED_SALT + 100 + salt)
            variation_seed, strength = None, 0.0
            identity = _identity(prompt, seed, None, 0.0, regions)
            salt += 1
        used.add(identity)
        edit = _edit_label(move, kind)
        drafts.append(CandidateDraft(
            prompt, seed, negative, parent.id if parent else None, edit,
            variation_seed=variation_seed, variation_strength=strength, regions=regions,
        ))
        moves.append({"move": i, "kind": move.kind, "edit": edit, "why": move.why})
    return drafts, {"moves": moves, "mapped": mapped, "dropped": dropped}


def _template(ctx: ReviserContext, move: Move, parent: CandidateView | None) -> tuple[str, Layout]:
    """The prompt and layout a move draws."""
    regions: Layout = tuple((r.prompt, r.x, r.y) for r in move.regions or ())
    if move.kind == "layout":
        return move.prompt or ctx.spec.goal, regions
    if move.kind == "prompt":
        return move.prompt or ctx.spec.goal, ()
    assert parent is not None
    if move.kind == "repair" and parent.regions:
        # the region whose anchor lies nearest the repaired area takes the repair's prompt
        cx, cy = move.area.center if move.area else (0.5, 0.5)
        near = min(range(len(parent.regions)),
                   key=lambda j: (parent.regions[j][1] - cx) ** 2 + (parent.regions[j][2] - cy) ** 2)
        assert move.prompt is not None
        return parent.prompt, tuple(
            (move.prompt, *r[1:]) if j == near else r  # type: ignore[misc]
            for j, r in enumerate(parent.regions))
    return move.prompt or parent.prompt, regions or parent.regions


def _noise(
    ctx: ReviserContext, move: Move, kind: str, parent: CandidateView | None, ordinal: int,
) -> tuple[int, int | None, float]:
    """(seed, variation seed, variation strength) of a move."""
    new = derive_seed(ctx.spec.seed, ctx.iteration, ordinal, SEED_SALT)
    if isinstance(move.seed, int):
        seed = move.seed
    elif move.seed == "new" or parent is None or (move.seed is None and kind != "refine"):
        seed = new
    else:
        seed = parent.seed
    strength = move.variation_strength or 0.0
    if kind == "refine" and parent is not None and seed == parent.seed:
        if strength > 0:
            return seed, derive_seed(ctx.spec.seed, ctx.iteration, ordinal, SEED_SALT + 50), strength
        return seed, parent.variation_seed, parent.variation_strength  # the parent's very noise
    if strength > 0:
        return seed, derive_seed(ctx.spec.seed, ctx.iteration, ordinal, SEED_SALT + 50), strength
    return seed, None, 0.0


def _edit_label(move: Move, kind: str) -> str:
    """The candidate's `edit`: `llm:<kind>`, with the original kind when it was mapped."""
    return f"llm:{kind}" if kind == move.kind else f"llm:{kind}<-{move.kind}"


def _draft_identity(d: CandidateDraft) -> Identity:
    return _identity(d.prompt, d.seed, d.variation_seed, d.variation_strength, d.regions)
