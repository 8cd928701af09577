"""The wire models: the HTTP API's request and response bodies, shared by the API and the SDK.

Imports only pydantic, the standard library and `agentloop.domain`'s plain text types (which
import pydantic alone), so that the SDK, the CLI's client commands and the MCP server work
in a client-only install (`pip install agentloop`): nothing here reaches FastAPI, the
database, pydantic-settings or the engine. `agentloop.api.schemas` re-exports these.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from agentloop.domain import (
    MAX_SEED,
    CandidateStatus,
    FiniteFloat,
    GoalStatus,
    IterationStatus,
    PromptText,
)
from agentloop.layout import MAX_REGION_SCALE, MAX_REGIONS

if TYPE_CHECKING:
    from agentloop.domain import (
        CandidateView,
        EventView,
        GoalState,
        GoalView,
        IterationView,
        WebhookDeliveryView,
    )

SCORE_SCALE = "CLIPScore = 2.5 * max(cos, 0), Hessel et al. 2021; range 0 to 2.5"


def _as_utc(value: datetime) -> datetime:
    # The store keeps naive UTC (one form on every backend); answers carry the offset.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


UtcDateTime = Annotated[datetime, AfterValidator(_as_utc)]
"""A timestamp in UTC that carries its offset: RFC 3339 in JSON (`2025-01-02T03:04:05Z`).
A naive value (as stored) is read as UTC."""


class CandidateOut(BaseModel):
    """One generation: what was asked, who ran it, how long it took, how it scored."""

    id: str
    iteration: int
    ordinal: int
    status: CandidateStatus
    prompt: str
    negative_prompt: str
    seed: int
    params: dict[str, Any]
    attempts: int
    worker: str | None
    clip_score: float | None = Field(description=f"{SCORE_SCALE}; null unless succeeded")
    part_scores: dict[str, float] = Field(description=f"per goal part; {SCORE_SCALE}")
    score_scale: str = SCORE_SCALE
    preview_score: float | None = Field(
        default=None, description="the score of its mid-denoise preview, where its prune group "
        "was previewed (the reviser's objective on the CLIPScore scale); null otherwise")
    pruned_at_step: int | None = Field(
        default=None, description="status pruned: the denoising step it was cut after (its "
        "image is that step's preview; it cost pruned_at_step / steps of a generation)")
    artifact_url: str | None
    timings: dict[str, float]
    error: str | None
    parent_id: str | None = Field(description="the candidate it was made from (an edit, "
                                  "a repair, a refinement); null for a fresh sample")
    edit: str | None = Field(description="how it was made: seed, layout, an edit kind, "
                             "variation:<s>, repair:<part>, refine, external")
    init_image_url: str | None = Field(
        default=None, description="the image it started from (a parent's image or the "
        "goal's init image); null for text-to-image. `params` holds `strength` and, for a "
        "repair, `repair_region`")
    queued_at: UtcDateTime | None
    started_at: UtcDateTime | None
    finished_at: UtcDateTime | None

    @classmethod
    def of(cls, c: CandidateView) -> CandidateOut:
        url = f"/v1/artifacts/{c.artifact_uri}" if c.artifact_uri else None
        init = f"/v1/artifacts/{c.init_image}" if c.init_image else None
        return cls(
            id=c.id, iteration=c.iteration, ordinal=c.ordinal, status=c.status,
            prompt=c.prompt, negative_prompt=c.negative_prompt, seed=c.seed, params=c.params,
            attempts=c.attempts, worker=c.worker, clip_score=c.clip_score,
            part_scores=c.part_scores, preview_score=c.preview_score,
            pruned_at_step=c.pruned_at_step, artifact_url=url, timings=c.timings, error=c.error,
            parent_id=c.parent_id, edit=c.edit, init_image_url=init,
            queued_at=c.queued_at, started_at=c.started_at,
            finished_at=c.finished_at,
        )


class IterationOut(BaseModel):
    index: int
    status: IterationStatus
    best_score: float | None
    notes: dict[str, Any]

    @classmethod
    def of(cls, it: IterationView) -> IterationOut:
        return cls(index=it.index, status=it.status, best_score=it.best_score, notes=it.notes)


class GoalOut(BaseModel):
    """A goal, its progress and its best candidate so far."""

    id: str
    tenant: str
    goal: str
    status: GoalStatus
    stop_reason: str | None
    error: str | None
    spec: dict[str, Any]
    budget: int
    generations_reserved: int = Field(
        description="generations counted against the budget: one per candidate created, a "
        "prune group its denoiser passes in generations, rounded up")
    generations_done: int = Field(
        description="candidates finished (succeeded, failed, cancelled or pruned)")
    best_score: float | None = Field(description=SCORE_SCALE)
    score_scale: str = SCORE_SCALE
    best_candidate: CandidateOut | None
    iterations: list[IterationOut]
    created_at: UtcDateTime | None
    finished_at: UtcDateTime | None

    @classmethod
    def of(cls, goal: GoalView, state: GoalState | None = None) -> GoalOut:
        cands = state.candidates if state else []
        best = next((c for c in cands if c.id == goal.best_candidate_id), None)
        return cls(
            id=goal.id, tenant=goal.tenant, goal=goal.text, status=goal.status,
            stop_reason=goal.stop_reason, error=goal.error, spec=goal.spec.to_json(),
            budget=goal.budget, generations_reserved=goal.generations_reserved,
            generations_done=sum(1 for c in cands if c.status.terminal),
            best_score=goal.best_score, best_candidate=CandidateOut.of(best) if best else None,
            iterations=[IterationOut.of(i) for i in state.iterations] if state else [],
            created_at=goal.created_at, finished_at=goal.finished_at,
        )

    @classmethod
    def summary(
        cls, goal: GoalView, done: int, best: CandidateView | None,
        iterations: list[IterationView],
    ) -> GoalOut:
        """A goal as listed: its counts, best candidate and iterations, no other candidates."""
        return cls(
            id=goal.id, tenant=goal.tenant, goal=goal.text, status=goal.status,
            stop_reason=goal.stop_reason, error=goal.error, spec=goal.spec.to_json(),
            budget=goal.budget, generations_reserved=goal.generations_reserved,
            generations_done=done, best_score=goal.best_score,
            best_candidate=CandidateOut.of(best) if best else None,
            iterations=[IterationOut.of(i) for i in iterations],
            created_at=goal.created_at, finished_at=goal.finished_at,
        )


class FieldError(BaseModel):
    """One refused input of a 422."""

    field: str = Field(description="dotted path of the input, e.g. `budget`, `prompts.0.seed`")
    message: str
    type: str


class ErrorInfo(BaseModel):
    """What went wrong, for a program (`code`) and for a person (`message`)."""

    code: str = Field(description="stable and machine-readable; see docs/api.md for the table",
                      examples=["iteration_open"])
    message: str
    field: str | None = Field(default=None, description="the one input at fault, if one is")
    errors: list[FieldError] | None = Field(default=None, description="422: every refused input")


class ErrorOut(BaseModel):
    """The one error body of every route. `detail` repeats FastAPI's former body (a message,
    or for a 422 the `[{"loc", "msg", "type"}]` list) for older clients."""

    error: ErrorInfo
    detail: Any = Field(default=None, description="deprecated: read `error` instead")


class RegionIn(BaseModel):
    """One region of a layout: its prompt draws the area nearest its anchor (x, y)."""

    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[PromptText, Field(min_length=1)]
    x: FiniteFloat = Field(ge=0, le=1, description="anchor, 0 = left edge, 1 = right edge")
    y: FiniteFloat = Field(ge=0, le=1, description="anchor, 0 = top edge, 1 = bottom edge")
    scale: FiniteFloat = Field(
        default=1.0, gt=0, le=MAX_REGION_SCALE,
        description="how far the region reaches relative to others (a large object's 1.2, a "
        "small one's 0.85); default 1",
    )


class PromptIn(BaseModel):
    """One prompt an external reviser supplies."""

    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[PromptText, Field(min_length=1)]
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    negative_prompt: PromptText | None = None
    variation_seed: int | None = Field(
        default=None, ge=0, le=MAX_SEED,
        description="blend this seed's initial noise into the seed's (with variation_strength)",
    )
    variation_strength: FiniteFloat = Field(default=0.0, ge=0, le=1)
    regions: list[RegionIn] = Field(
        default_factory=list, max_length=MAX_REGIONS,
        description="a layout: each region's prompt draws the area nearest its anchor; the "
        "image is still scored against the goal. Costs one denoiser pass per region. "
        "Flux-family models only.",
    )


class IterationIn(BaseModel):
    """The next iteration's prompts for a goal with reviser 'external'."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[PromptIn] = Field(min_length=1, max_length=256)


class IterationAccepted(BaseModel):
    goal_id: str
    iteration: int
    candidate_ids: list[str]


class ModelsOut(BaseModel):
    """The models and scorers this installation knows (`GET /v1/models`)."""

    models: list[str] = Field(
        description="model names a goal may give as `model`: the presets, `shapes` when its "
        "weights are installed, and the hub ids or folders the operator registered"
    )
    scorers: list[str] = Field(
        description="scorer names a goal may give as `scorer`; any open_clip "
        "'name:pretrained' is accepted too (open-ended, not listed)"
    )
    revisers: list[str] = Field(
        default_factory=lambda: ["search", "external"],
        description="reviser names a goal may give as `reviser` here: 'search' and "
        "'external' always, 'llm' when the server has a language model endpoint",
    )
    default_model: str = Field(description="the model a goal without `model` gets")
    default_scorer: str = Field(description="the scorer a goal without `scorer` gets")
    score_scale: str = SCORE_SCALE


class EventOut(BaseModel):
    """One event of a goal's log; `id` only grows (the SSE `id:`, and the `Last-Event-ID` to
    resume from)."""

    id: int
    goal_id: str
    type: str = Field(description="goal.created, goal.status, goal.best, goal.finished, "
                      "iteration.opened, iteration.closed, iteration.withdrawn, "
                      "candidate.started, candidate.succeeded, candidate.failed, "
                      "candidate.cancelled, candidate.pruned")
    data: dict[str, Any]
    created_at: UtcDateTime

    @classmethod
    def of(cls, e: EventView) -> EventOut:
        return cls(id=e.id, goal_id=e.goal_id, type=e.type, data=e.data, created_at=e.created_at)


class WebhookDeliveryOut(BaseModel):
    """One event sent to a goal's webhook: its attempts and outcome (`pending`: waiting for
    its next attempt, `delivering`: being sent, `delivered`: a 2xx answer, `failed`: every
    attempt spent)."""

    id: int
    goal_id: str
    event_id: int = Field(description="the event sent (its `webhook-id` is `evt_<event_id>`)")
    event_type: str
    url: str
    status: Literal["pending", "delivering", "delivered", "failed"]
    attempts: int = Field(description="attempts made so far")
    next_attempt_at: UtcDateTime | None = Field(
        description="when it is tried next (pending), or taken again should its sender have "
        "died (delivering); null once it is delivered or failed")
    last_status_code: int | None = Field(description="the last attempt's HTTP status, if any")
    last_error: str | None = Field(description="why the last attempt failed")
    created_at: UtcDateTime
    delivered_at: UtcDateTime | None

    @classmethod
    def of(cls, d: WebhookDeliveryView) -> WebhookDeliveryOut:
        return cls(
            id=d.id, goal_id=d.goal_id, event_id=d.event_id, event_type=d.event_type,
            url=d.url, status=d.status, attempts=d.attempts,  # type: ignore[arg-type]
            next_attempt_at=d.next_attempt_at, last_status_code=d.last_status_code,
            last_error=d.last_error, created_at=d.created_at, delivered_at=d.delivered_at,
        )
