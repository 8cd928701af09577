"""Domain types: statuses, the goal spec and its validation, plain views of stored rows."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from agentloop.settings import Settings


class GoalStatus(StrEnum):
    """Where a goal is in its life."""

    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"  # external reviser: waiting for the caller's next prompts
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (GoalStatus.DONE, GoalStatus.FAILED, GoalStatus.CANCELLED)


class StopReason(StrEnum):
    """Why a goal stopped."""

    TARGET_REACHED = "target_reached"
    BUDGET_SPENT = "budget_spent"
    MAX_ITERATIONS = "max_iterations"
    NO_IMPROVEMENT = "no_improvement"
    GENERATION_FAILED = "generation_failed"
    DISPATCH_FAILED = "dispatch_failed"
    REVISER_FAILED = "reviser_failed"
    CLOSED_BY_CALLER = "closed_by_caller"
    CANCELLED_BY_CALLER = "cancelled_by_caller"


class IterationStatus(StrEnum):
    """An iteration is open while any of its candidates is unfinished."""

    OPEN = "open"
    CLOSED = "closed"


class CandidateStatus(StrEnum):
    """One generation's life: queued → running → succeeded | failed (running → queued on retry,
    or when its lease expires); queued → cancelled when its goal is cancelled; running →
    pruned when its prune group cut it mid-denoise (its image is then the preview it was
    judged by, and it is never a goal's best)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PRUNED = "pruned"

    @property
    def terminal(self) -> bool:
        return self in (
            CandidateStatus.SUCCEEDED, CandidateStatus.FAILED, CandidateStatus.CANCELLED,
            CandidateStatus.PRUNED,
        )


class GoalInvalid(ValueError):
    """A goal spec was rejected; `errors` holds (field, message) pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{f}: {m}" for f, m in errors))

    def first_line(self) -> str:
        """One line naming the first bad field, for a terminal."""
        field_name, message = self.errors[0]
        return f"invalid {field_name}: {message}"


MAX_PROMPT_CHARS = 2000
"""Longest prompt, negative prompt or region prompt (CLIP reads the first 77 tokens anyway)."""

MAX_TENANT_CHARS = 64
"""Longest tenant name: the width of the goals.tenant column."""

MAX_ITERATIONS = 10_000
"""Most iterations (and most patience) a goal may ask for; the budget ends a loop long before."""

MAX_SEED = 2**53 - 1
"""Largest seed a caller may give: the largest integer every JSON reader keeps exactly
(RFC 7493); derived seeds are 31-bit."""

MAX_NAME_CHARS = 512
"""Longest model or scorer name (a preset, a hub id, a local path)."""

NO_NUL_PATTERN = r"^[^\x00]*$"
"""JSON Schema pattern for text without NUL (lone surrogates cannot be sent as UTF-8 at all)."""

_NOT_SPACE = r"[^\x00\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
GOAL_PATTERN = rf"^[^\x00]*{_NOT_SPACE}[^\x00]*$"
"""JSON Schema pattern for a goal: no NUL, and at least one character that is not white space
(Python's white space, spelled out, since JSON Schema's `\\s` is ECMAScript's)."""


def _storable_text(value: str) -> str:
    # PostgreSQL refuses NUL in text, and a lone surrogate has no UTF-8 form: either would
    # fail deep in the driver (a dropped connection, a 500) instead of naming the field.
    if "\x00" in value:
        raise ValueError("must not contain NUL (U+0000) characters")
    if any("\ud800" <= ch <= "\udfff" for ch in value):
        raise ValueError("must not contain lone surrogates (U+D800 to U+DFFF)")
    return value


SafeStr = Annotated[
    str, Field(json_schema_extra={"pattern": NO_NUL_PATTERN}), AfterValidator(_storable_text)
]
"""A string any backend can store: no NUL, no lone surrogate. The one place the API's text
rules live; each use adds its length limit (`Annotated[SafeStr, Field(max_length=...)]`)."""

PromptText = Annotated[SafeStr, Field(max_length=MAX_PROMPT_CHARS)]
"""A prompt or negative prompt."""

TenantName = Annotated[SafeStr, Field(min_length=1, max_length=MAX_TENANT_CHARS)]
"""A tenant, as the goals.tenant column holds it."""

ModelName = Annotated[SafeStr, Field(max_length=MAX_NAME_CHARS)]
"""A model or scorer name."""


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
"""A float that is neither NaN nor infinite (Python's json reads `NaN` and `Infinity`)."""

DEFAULT_INIT_STRENGTH = 0.6
"""How much of the schedule a goal's first refinements of its init image run again: enough
to change details and fix attributes, little enough to keep the image's composition."""


def _whole_float_as_int(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


JsonInt = Annotated[int, BeforeValidator(_whole_float_as_int)]
"""An integer as JSON has it: `16` or `16.0` (JSON has one number type, and JSON Schema counts
`16.0` as an integer); still never a string or a boolean, even in a strict model."""


EVENT_TYPES = (
    "goal.created", "goal.status", "goal.best", "goal.finished", "iteration.opened",
    "iteration.closed", "iteration.withdrawn", "candidate.started", "candidate.succeeded",
    "candidate.failed", "candidate.cancelled", "candidate.pruned",
)
"""Every event type the log writes (see `EventView`)."""

EventType = Literal[
    "goal.created", "goal.status", "goal.best", "goal.finished", "iteration.opened",
    "iteration.closed", "iteration.withdrawn", "candidate.started", "candidate.succeeded",
    "candidate.failed", "candidate.cancelled", "candidate.pruned", "*",
]
"""An event type a webhook may subscribe to; "*" is every type."""

MAX_WEBHOOK_URL_CHARS = 2000
WEBHOOK_URL_PATTERN = r"^https?://[A-Za-z0-9._~-]+(:[0-9]{1,5})?([/?#][^\x00]*)?$"
"""A webhook URL: http or https, a host name or IPv4 address (no user info), an optional
port, then anything storable. The API checks exactly this; OpenAPI publishes it."""
WEBHOOK_SECRET_PATTERN = (
    r"^whsec_([A-Za-z0-9+/]{4}){8,21}([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
)
"""A Standard Webhooks secret: `whsec_` and the padded base64 of 24 to 65 random bytes."""


def webhook_url_problem(url: str) -> str | None:
    """Why `url` is no webhook URL (None: it is one)."""
    if not re.fullmatch(WEBHOOK_URL_PATTERN, url):
        return "must be an http or https URL with a host name (no user info)"
    return None


def webhook_secret_problem(secret: str) -> str | None:
    """Why `secret` is no Standard Webhooks secret (None: it is one)."""
    if not re.fullmatch(WEBHOOK_SECRET_PATTERN, secret):
        return "must be 'whsec_' followed by the padded base64 of 24 to 65 bytes"
    return None


class WebhookRequest(BaseModel):
    """Where to POST a goal's events, and which ones (signed per Standard Webhooks)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: Annotated[SafeStr, Field(min_length=1, max_length=MAX_WEBHOOK_URL_CHARS,
                                  description="an http(s) URL")]
    events: list[EventType] = Field(
        default_factory=lambda: ["goal.finished"], min_length=1,
        max_length=len(EVENT_TYPES) + 1,
        description='event types to send ("*": all); default ["goal.finished"]',
    )
    secret: Annotated[SafeStr, Field(
        max_length=200, description="whsec_<base64>; default: the server's webhook_secret. "
        "Never returned.")] | None = None


@dataclass(frozen=True)
class Webhook:
    """A goal's webhook as stored: the secret lives in the webhooks table, never the spec."""

    url: str
    events: tuple[str, ...]
    secret: str = field(repr=False)


MAX_PART_SCALE = 2.0
MIN_PART_SCALE = 0.5


class PartRequest(BaseModel):
    """One part of a goal as the caller reads it: what it is, and where and how large."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: Annotated[PromptText, Field(
        min_length=1, description="the part's words, e.g. 'a red circle on the left': its "
        "score's key and, without a layout entry of its own, what its region draws")]
    place: list[FiniteFloat] | None = Field(
        default=None, min_length=2, max_length=2,
        description="[x, y] in [0, 1] from the top-left corner; null: let the planner place it")
    scale: FiniteFloat = Field(
        default=1.0, description=f"how far its region reaches, in [{MIN_PART_SCALE}, "
        f"{MAX_PART_SCALE}] (1: an equal share; 'small' reads as 0.85, 'large' as 1.2)")


class GoalRequest(BaseModel):
    """What a caller may ask for. Unset fields take the model's or the settings' defaults.

    The types keep out what no backend can store (NUL, lone surrogates, NaN, over-long text);
    ranges are checked by `check_goal`, so that one answer names every bad field, and the API
    writes them, with this deployment's limits, into its OpenAPI schema
    (`agentloop.api.openapi`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    goal: SafeStr  # at most the settings' max_goal_chars, checked by check_goal
    budget: JsonInt = 16
    fanout: JsonInt = 4
    max_iterations: JsonInt = 8
    target_score: FiniteFloat | None = None
    patience: JsonInt = 3
    model: ModelName | None = None
    scorer: ModelName | None = None
    steps: JsonInt | None = None
    size: JsonInt | None = None
    guidance: FiniteFloat | None = None
    seed: JsonInt = 0
    negative_prompt: PromptText = ""
    reviser: Literal["search", "external", "llm"] = "search"
    tenant: TenantName = "default"
    webhook: WebhookRequest | None = None
    init_image: Annotated[str, Field(
        description="start from this image: PNG or JPEG, base64 (a data: URL is accepted); "
        "at most the server's max_init_image_bytes once decoded")] | None = None
    init_candidate_id: Annotated[SafeStr, Field(
        max_length=64, description="start from this earlier candidate's image (same tenant)")] | None = None
    init_strength: FiniteFloat | None = Field(
        default=None, description="with init_image or init_candidate_id: how much of the "
        f"schedule runs again, in (0, 1]; default {DEFAULT_INIT_STRENGTH}")
    parts: list[PartRequest] | None = Field(
        default=None, description="the goal's objects as the caller reads them (2 to 8): "
        "each is scored on its own, on its region; unset: the server parses the goal text")


@dataclass(frozen=True)
class GoalSpec:
    """A validated goal with every default resolved; stored as the goal's `spec` JSON."""

    goal: str
    budget: int
    fanout: int
    max_iterations: int
    target_score: float | None
    patience: int
    model: str
    scorer: str
    steps: int
    size: int
    guidance: float
    seed: int
    negative_prompt: str
    reviser: str
    tenant: str
    webhook: dict[str, Any] | None = None
    """The webhook's url and events (its secret is kept out of the spec); None: no webhook."""
    init_image: str | None = None
    """The image the goal starts from, an artifact path (an upload, or an earlier candidate's
    image); None: the goal starts from text."""
    init_strength: float | None = None
    """With ``init_image``: how much of the schedule each refinement of it runs again."""
    init_candidate_id: str | None = None
    """The earlier candidate whose image ``init_image`` is, if it came from one."""
    parts: tuple[dict[str, Any], ...] | None = None
    """The goal's parts (`agentloop.parts.part_to_json`), when the caller gave them or a
    parser that reads a goal once (the `llm` parser) did; None: the rules parse the text
    wherever parts are needed."""

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        for optional in ("webhook", "init_image", "init_strength", "init_candidate_id", "parts"):
            if data[optional] is None:
                del data[optional]  # the spec of a goal without one reads as it always did
        if data.get("parts") is not None:
            data["parts"] = [dict(p) for p in data["parts"]]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GoalSpec:
        if data.get("parts") is not None:
            data = {**data, "parts": tuple(dict(p) for p in data["parts"])}
        return cls(**data)


def available_revisers(settings: Settings) -> list[str]:
    """The revisers a goal may choose on this deployment: `llm` only with an endpoint."""
    return ["search", "external"] + (["llm"] if settings.llm_base_url and settings.llm_model else [])


# The catalog answers "does this model exist" without importing torch.
def _model_defaults(model: str, extra_models: tuple[str, ...]) -> dict[str, Any]:
    from engine.defaults import model_defaults

    return model_defaults(model, extra_models)


def _pick_default(preferred: str, fallback: str, known: bool) -> str:
    return preferred if known else fallback


def check_goal(data: dict[str, Any] | GoalRequest, settings: Settings) -> GoalSpec:
    """Validate a goal request against the settings' limits; raise GoalInvalid naming each field."""
    from engine.catalog import is_known_model, is_known_scorer

    if isinstance(data, GoalRequest):
        req = data
    else:
        try:
            req = GoalRequest.model_validate(data)
        except ValidationError as exc:
            raise GoalInvalid(
                [(".".join(str(p) for p in e["loc"]) or "body", e["msg"]) for e in exc.errors()]
            ) from None
    errors: list[tuple[str, str]] = []
    text = re.sub(r"\s+", " ", req.goal).strip()
    if not text:
        errors.append(("goal", "must not be empty"))
    elif len(req.goal) > settings.max_goal_chars:
        errors.append(("goal", f"must be at most {settings.max_goal_chars} characters"))
    if not 1 <= req.budget <= settings.max_budget:
        errors.append(("budget", f"must be between 1 and {settings.max_budget}"))
    if not 1 <= req.fanout <= settings.max_fanout:
        errors.append(("fanout", f"must be between 1 and {settings.max_fanout}"))
    if not 1 <= req.max_iterations <= MAX_ITERATIONS:
        errors.append(("max_iterations", f"must be between 1 and {MAX_ITERATIONS}"))
    if not 1 <= req.patience <= MAX_ITERATIONS:
        errors.append(("patience", f"must be between 1 and {MAX_ITERATIONS}"))
    if req.target_score is not None and not 0 < req.target_score <= 2.5:
        errors.append(("target_score", "must be in (0, 2.5] (CLIPScore, Hessel et al. scale)"))
    if req.reviser not in ("search", "external", "llm"):
        errors.append(("reviser", "must be 'search', 'external' or 'llm'"))
    elif req.reviser not in available_revisers(settings):
        errors.append(("reviser", "'llm' needs a language model endpoint, and this server has "
                       "none: set AGENTLOOP_LLM_BASE_URL and AGENTLOOP_LLM_MODEL (docs/revisers.md)"))
    if req.guidance is not None and req.guidance < 0:
        errors.append(("guidance", "must be >= 0"))
    if not 0 <= req.seed <= MAX_SEED:
        errors.append(("seed", f"must be between 0 and {MAX_SEED} (2**53-1)"))
    extra_m = tuple(settings.extra_models)
    model = req.model if req.model is not None else _pick_default(
        settings.default_model, "tiny-dit", is_known_model(settings.default_model, extra_m)
    )
    if not is_known_model(model, extra_m):
        errors.append(("model", f"unknown model {model!r}"))
    scorer = req.scorer if req.scorer is not None else _pick_default(
        settings.default_scorer, "tiny-clip", is_known_scorer(settings.default_scorer)
    )
    if not is_known_scorer(scorer):
        errors.append(("scorer", f"unknown scorer {scorer!r}"))
    defaults = _model_defaults(model, extra_m) if not any(f == "model" for f, _ in errors) else {}
    steps = req.steps if req.steps is not None else int(defaults.get("steps", 20))
    if not 1 <= steps <= settings.max_steps:
        errors.append(("steps", f"must be between 1 and {settings.max_steps}"))
    size = req.size if req.size is not None else int(defaults.get("size", 32))
    if size <= 0 or size % 8:
        errors.append(("size", "must be a positive multiple of 8"))
    elif size > settings.max_size:
        errors.append(("size", f"must be at most {settings.max_size}"))
    webhook = _check_webhook(req.webhook, settings, errors)
    if req.init_image is not None and req.init_candidate_id is not None:
        errors.append(("init_image", "give init_image or init_candidate_id, not both"))
    if req.init_strength is not None:
        if req.init_image is None and req.init_candidate_id is None:
            errors.append(("init_strength", "needs init_image or init_candidate_id"))
        elif not 0 < req.init_strength <= 1:
            errors.append(("init_strength", "must be in (0, 1]"))
    parts = _check_parts(req.parts, errors)
    if errors:
        raise GoalInvalid(errors)
    guidance = req.guidance if req.guidance is not None else float(defaults.get("guidance", 1.0))
    return GoalSpec(
        goal=text, budget=req.budget, fanout=req.fanout, max_iterations=req.max_iterations,
        target_score=req.target_score, patience=req.patience, model=model, scorer=scorer,
        steps=steps, size=size, guidance=guidance, seed=req.seed,
        negative_prompt=req.negative_prompt, reviser=req.reviser, tenant=req.tenant,
        webhook=webhook,
        init_strength=(req.init_strength if req.init_strength is not None else DEFAULT_INIT_STRENGTH)
        if req.init_image is not None or req.init_candidate_id is not None else None,
        parts=parts,
    )


def _check_parts(
    parts: list[PartRequest] | None, errors: list[tuple[str, str]]
) -> tuple[dict[str, Any], ...] | None:
    """The caller's parts as stored (`agentloop.parts.part_to_json`); problems to `errors`."""
    from agentloop.parts import MAX_PARTS, part_from_json, part_to_json

    if parts is None:
        return None
    if not 2 <= len(parts) <= MAX_PARTS:
        errors.append(("parts", f"must list 2 to {MAX_PARTS} parts (a goal of one object "
                       "needs none)"))
        return None
    seen: set[str] = set()
    out = []
    for k, part in enumerate(parts):
        text = re.sub(r"\s+", " ", part.text).strip()
        if not text:
            errors.append((f"parts.{k}.text", "must not be empty"))
        elif text.lower() in seen:
            errors.append((f"parts.{k}.text", f"repeats part {text!r}: each part's text must "
                           "be distinct (it keys the part's score)"))
        seen.add(text.lower())
        if part.place is not None and not all(0 <= v <= 1 for v in part.place):
            errors.append((f"parts.{k}.place", "x and y must be in [0, 1]"))
        if not MIN_PART_SCALE <= part.scale <= MAX_PART_SCALE:
            errors.append((f"parts.{k}.scale", f"must be in [{MIN_PART_SCALE}, {MAX_PART_SCALE}]"))
        data: dict[str, Any] = {"text": text, "place": part.place, "scale": part.scale}
        out.append(part_to_json(part_from_json(data)) if text else data)
    return tuple(out)


def _check_webhook(
    req: WebhookRequest | None, settings: Settings, errors: list[tuple[str, str]]
) -> dict[str, Any] | None:
    """The webhook's public part (url, events) for the spec; its problems go to `errors`."""
    if req is None:
        return None
    if problem := webhook_url_problem(req.url):
        errors.append(("webhook.url", problem))
    if req.secret is not None:
        if problem := webhook_secret_problem(req.secret):
            errors.append(("webhook.secret", problem))
    elif not settings.webhook_secret:
        errors.append(("webhook.secret", "required (no server default configured)"))
    events = ["*"] if "*" in req.events else list(dict.fromkeys(req.events))
    return {"url": req.url, "events": events}


def webhook_of(spec: GoalSpec, req: GoalRequest, settings: Settings) -> Webhook | None:
    """The goal's webhook with its secret (the request's, else the server's), once
    `check_goal` accepted the request."""
    if spec.webhook is None or req.webhook is None:
        return None
    secret = req.webhook.secret or settings.webhook_secret
    assert secret is not None  # check_goal refused the request otherwise
    return Webhook(spec.webhook["url"], tuple(spec.webhook["events"]), secret)


LayoutEntry = tuple[str, float, float] | tuple[str, float, float, float]
"""One region of a layout: (prompt, x, y), or (prompt, x, y, scale) for a region whose reach
differs from 1 (a size word: "a small ..." 0.85, "a large ..." 1.2)."""

Layout = tuple[LayoutEntry, ...]
"""A layout: one entry per region, the anchor (x, y) in [0, 1] from the top-left corner."""


def layout_entry(prompt: str, x: float, y: float, scale: float = 1.0) -> LayoutEntry:
    """A layout entry in its one canonical form: three values when the scale is 1 (as layouts
    were before scales existed, so stored params and API bodies read the same), else four."""
    if float(scale) == 1.0:
        return (str(prompt), float(x), float(y))
    return (str(prompt), float(x), float(y), float(scale))


def entry_values(entry: Sequence[Any]) -> tuple[str, float, float, float]:
    """(prompt, x, y, scale) of a layout entry of three or four values."""
    if len(entry) not in (3, 4):
        raise ValueError(f"a layout entry is (prompt, x, y[, scale]), not {list(entry)!r}")
    prompt, x, y, *rest = entry
    return (str(prompt), float(x), float(y), float(rest[0]) if rest else 1.0)


def split_parts(text: str) -> tuple[str, ...]:
    """The parts a score is kept for ("a red circle, plus a blue square"), by the rule
    parser (`agentloop.parts`); () for a goal of one object."""
    from agentloop.parts import part_texts

    return part_texts(text)


@dataclass
class CandidateView:
    """A stored candidate, as plain data."""

    id: str
    goal_id: str
    iteration: int
    ordinal: int
    prompt: str
    negative_prompt: str
    seed: int
    params: dict[str, Any]
    status: CandidateStatus
    attempts: int
    worker: str | None
    clip_score: float | None
    part_scores: dict[str, float]
    artifact_uri: str | None
    timings: dict[str, float]
    error: str | None
    parent_id: str | None
    edit: str | None
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    claim_token: str | None = None
    """The claim a worker holds on it while running; completion must present it."""
    lease_expires_at: datetime | None = None
    """While running: when the claim lapses unless the worker renews it (database clock)."""
    dispatched_at: datetime | None = None
    """When its generation message was last sent (None: not sent yet)."""

    @property
    def variation_seed(self) -> int | None:
        """Its noise variation's seed, from its params (None: no variation)."""
        seed = self.params.get("variation_seed")
        return None if seed is None else int(seed)

    @property
    def variation_strength(self) -> float:
        """Its noise variation's strength, from its params (0: no variation)."""
        return float(self.params.get("variation_strength", 0.0))

    @property
    def regions(self) -> Layout:
        """Its layout, (prompt, x, y[, scale]) per region, from its params (() for none)."""
        return tuple(layout_entry(*entry_values(r)) for r in self.params.get("regions", ()))

    @property
    def prune_group(self) -> str | None:
        """The prune group it runs in, from its params (None: it always finishes)."""
        group = self.params.get("prune_group")
        return None if group is None else str(group)

    @property
    def preview_score(self) -> float | None:
        """The score its mid-denoise preview got, where its prune group was previewed
        (objective scale, see ``agentloop.revisers.objective``); None otherwise."""
        value = self.timings.get("preview_score")
        return None if value is None else float(value)

    @property
    def pruned_at_step(self) -> int | None:
        """After how many denoising steps it was cut (pruned candidates only)."""
        value = self.timings.get("pruned_at_step")
        return None if value is None else int(value)

    @property
    def init_image(self) -> str | None:
        """The image it starts from (an artifact path), from its params (None: text-to-image)."""
        value = self.params.get("init_image")
        return None if value is None else str(value)

    @property
    def strength(self) -> float:
        """How much of the schedule it runs again from its init image, in (0, 1] (1 without)."""
        return float(self.params.get("strength", 1.0))

    @property
    def repair_region(self) -> int | None:
        """The region of its layout it draws again over its init image (None: not a repair)."""
        value = self.params.get("repair_region")
        return None if value is None else int(value)


@dataclass
class IterationView:
    """A stored iteration, as plain data."""

    index: int
    status: IterationStatus
    notes: dict[str, Any]
    best_score: float | None
    created_at: datetime | None
    closed_at: datetime | None


@dataclass
class GoalView:
    """A stored goal, as plain data."""

    id: str
    tenant: str
    text: str
    spec: GoalSpec
    status: GoalStatus
    stop_reason: str | None
    budget: int
    generations_reserved: int
    best_candidate_id: str | None
    best_score: float | None
    error: str | None
    created_at: datetime | None
    updated_at: datetime | None
    finished_at: datetime | None


@dataclass
class GoalState:
    """Everything the orchestrator reads for one decision, taken under the goal's lock."""

    goal: GoalView
    iterations: list[IterationView]
    candidates: list[CandidateView] = field(default_factory=list)
    now: datetime | None = None
    """The database's clock when the state was read (leases and sweeps are judged by it)."""

    def of_iteration(self, index: int) -> list[CandidateView]:
        return [c for c in self.candidates if c.iteration == index]


@dataclass(frozen=True)
class EventView:
    """One entry of a goal's event log: `id` only grows, `type` names the transition
    (`goal.created`, `goal.status`, `goal.best`, `goal.finished`, `iteration.opened`,
    `iteration.closed`, `iteration.withdrawn`, `candidate.started`, `candidate.succeeded`,
    `candidate.failed`, `candidate.cancelled`, `candidate.pruned`), `data` what changed."""

    id: int
    goal_id: str
    type: str
    data: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class WebhookDeliveryView:
    """One event sent (or being sent) to a goal's webhook, with its attempts and outcome."""

    id: int
    goal_id: str
    event_id: int
    event_type: str
    url: str
    status: str
    """pending, delivering, delivered or failed."""
    attempts: int
    next_attempt_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None


@dataclass
class CandidateDraft:
    """A candidate a reviser proposes: what to generate, and where it came from."""

    prompt: str
    seed: int
    negative_prompt: str = ""
    parent_id: str | None = None
    edit: str | None = None
    variation_seed: int | None = None
    """Seed of a second noise blended into ``seed``'s initial noise (None: no variation)."""
    variation_strength: float = 0.0
    """How far toward ``variation_seed``'s noise, in [0, 1]; 0 is ``seed``'s own noise."""
    regions: Layout = ()
    """A layout, (prompt, x, y[, scale]) per region: each region's prompt draws the area
    nearest its anchor (x, y in [0, 1] from the top-left; a scale above 1 reaches further).
    Empty: ``prompt`` draws the whole image. A goal's planned layout has one region per part,
    in the parts' order."""
    prune_group: str | None = None
    """Names a prune group within its iteration: its members run together, are previewed
    after ``prune_at_step`` steps, and only the ``prune_keep`` best finish (the others end
    ``pruned``). None: the candidate always finishes."""
    prune_keep: int = 0
    prune_at_step: int = 0
    init_image: str | None = None
    """Image-to-image: the image to start from, an artifact path (a parent's image, or a
    goal's uploaded image). None: text-to-image."""
    strength: float = 1.0
    """With ``init_image``: how much of the schedule runs again, in (0, 1]."""
    repair_region: int | None = None
    """A repair: the region of ``regions`` drawn again over ``init_image``, the rest kept."""

    @property
    def has_variation(self) -> bool:
        """Whether this draft's initial noise differs from the plain noise of its seed."""
        return self.variation_seed is not None and self.variation_strength > 0

    def prune_params(self) -> dict[str, Any]:
        """Its prune group as candidate params; none for a draft that always finishes."""
        if self.prune_group is None:
            return {}
        return {"prune_group": self.prune_group, "prune_keep": self.prune_keep,
                "prune_at_step": self.prune_at_step}

    def unpruned(self) -> CandidateDraft:
        """The same draft without its prune group."""
        return replace(self, prune_group=None, prune_keep=0, prune_at_step=0)

    def noise_and_layout_params(self) -> dict[str, Any]:
        """Its variation, layout and init image as candidate params (what ``CandidateView``
        reads back); none at all for a plain draft."""
        params: dict[str, Any] = {}
        if self.has_variation:
            params |= {"variation_seed": self.variation_seed,
                       "variation_strength": self.variation_strength}
        if self.regions:
            params["regions"] = [list(layout_entry(*entry_values(r))) for r in self.regions]
        if self.init_image is not None:
            params |= {"init_image": self.init_image, "strength": float(self.strength)}
            if self.repair_region is not None:
                params["repair_region"] = int(self.repair_region)
        return params


def prune_groups(drafts: Sequence[CandidateDraft]) -> dict[str, list[CandidateDraft]]:
    """Drafts by prune group (drafts without one left out)."""
    groups: dict[str, list[CandidateDraft]] = {}
    for d in drafts:
        if d.prune_group is not None:
            groups.setdefault(d.prune_group, []).append(d)
    return groups


def finishing(drafts: Sequence[CandidateDraft]) -> int:
    """How many of ``drafts`` finish: those without a prune group, and each group's keep."""
    groups = prune_groups(drafts)
    plain = sum(d.prune_group is None for d in drafts)
    return plain + sum(min(len(g), g[0].prune_keep) for g in groups.values())


def generation_cost(drafts: Sequence[CandidateDraft], steps: int) -> int:
    """Generations of budget that ``drafts`` reserve: one per draft without a prune group;
    for a group of W cut after k of ``steps`` steps keeping m, m + ceil((W - m) * k / steps),
    its denoiser passes in generations (every member runs k steps, the kept ones all of
    them), rounded up."""
    groups = prune_groups(drafts)
    cost = sum(d.prune_group is None for d in drafts)
    for group in groups.values():
        keep = min(len(group), group[0].prune_keep)
        cut = max(0, min(group[0].prune_at_step, steps))
        cost += keep + math.ceil((len(group) - keep) * cut / steps - 1e-9)
    return cost


def prune_problems(drafts: Sequence[CandidateDraft], steps: int) -> list[str]:
    """Why ``drafts``' prune groups cannot run (members that disagree, a keep or a step out
    of range); empty when they can."""
    problems = []
    for name, group in prune_groups(drafts).items():
        first = group[0]
        if any((d.prune_keep, d.prune_at_step) != (first.prune_keep, first.prune_at_step)
               for d in group):
            problems.append(f"prune group {name!r}: members disagree on keep or step")
        if not 1 <= first.prune_keep:
            problems.append(f"prune group {name!r}: keep {first.prune_keep} < 1")
        if not 1 <= first.prune_at_step < steps:
            problems.append(f"prune group {name!r}: step {first.prune_at_step} not in [1, {steps})")
    return problems


@dataclass(frozen=True)
class Reclaim:
    """A running candidate whose lease expired, taken back from the worker that held it."""

    candidate_id: str
    claim_token: str
    status: CandidateStatus
    """QUEUED to run again, FAILED when its attempts are spent, CANCELLED if its goal ended."""
    error: str


@dataclass
class Decision:
    """What one orchestrator step decided; the store applies it in the same transaction."""

    close_iteration: int | None = None
    iteration_best: float | None = None
    best: tuple[str, float] | None = None
    new_candidates: list[CandidateDraft] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    goal_status: GoalStatus | None = None
    stop_reason: str | None = None
    error: str | None = None
    redispatch: list[str] = field(default_factory=list)
    """Queued candidates whose generation message must be sent (again)."""
    reclaim: list[Reclaim] = field(default_factory=list)
    dispatch: list[str] = field(default_factory=list)
    """Filled by the store: ids of candidates to hand to generation workers after commit."""
    model: str | None = None
    """Filled by the store: the goal's model, which names the generation queue."""

    @property
    def is_noop(self) -> bool:
        return not (
            self.close_iteration is not None or self.best or self.new_candidates
            or self.goal_status or self.redispatch or self.reclaim
        )


SWEEP_HEARTBEAT = "sweep"
"""The heartbeat the reconciler (the sweep) records after every run."""

HEARTBEAT_STALE_INTERVALS = 3.0
"""A periodic job whose last run is older than this many of its intervals has stopped."""


@dataclass(frozen=True)
class Heartbeat:
    """When a periodic job (the sweep) last finished a run, read by the database's clock."""

    name: str
    beat_at: datetime
    """When it last finished (naive UTC, the database's clock)."""
    age_seconds: float
    """How long ago that was, by the same clock."""
    interval_seconds: float
    """How often it runs."""

    @property
    def stale(self) -> bool:
        """Whether it has missed several runs in a row (it stopped, or cannot finish one)."""
        return self.age_seconds > HEARTBEAT_STALE_INTERVALS * self.interval_seconds
