"""The /v1 routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Body, Header, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from pydantic import Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from agentloop.api.deps import DispatcherDep, SettingsDep, StoreDep
from agentloop.api.errors import ApiError
from agentloop.api.idempotency import IdempotencyKey, request_hash, run_once
from agentloop.api.pagination import (
    CANDIDATE_CURSOR,
    GOAL_CURSOR,
    PAGE_HEADERS,
    candidate_cursor,
    candidate_position,
    goal_cursor,
    goal_position,
    set_next,
)
from agentloop.api.schemas import (
    CandidateOut,
    ErrorOut,
    EventOut,
    GoalOut,
    IterationAccepted,
    IterationIn,
    ModelsOut,
    WebhookDeliveryOut,
)
from agentloop.dispatch import dispatch_generation
from agentloop.domain import (
    CandidateDraft,
    CandidateStatus,
    GoalInvalid,
    GoalRequest,
    GoalSpec,
    GoalStatus,
    SafeStr,
    TenantName,
    available_revisers,
    check_goal,
    layout_entry,
    webhook_of,
)
from agentloop.orchestrator import (
    IterationRejected,
    cancel_goal,
    close_goal,
    fail_goal,
    submit_iteration,
)
from agentloop.parse_llm import with_parsed_parts
from agentloop.revisers import derive_seed
from agentloop.store import IdempotencyClaim

router = APIRouter(prefix="/v1")

GoalId = Annotated[SafeStr, Field(max_length=64)]
"""A goal id in a path (ids are 32 hex digits; anything else storable is simply not found)."""

ArtifactName = Annotated[SafeStr, Field(max_length=255)]
"""An image's file name in a path."""


def _answers(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route gives, each the one error body
    (`ErrorOut`); every route may answer 422 (its input) and 503 (the database is away)."""
    text = {400: "the body is not UTF-8", 404: "not found (`not_found`)",
            409: "not possible in the goal's state (`not_external`, `goal_not_waiting`, "
            "`iteration_open`, `budget_exceeded`, `goal_finished`), or a request with the "
            "same Idempotency-Key still runs (`idempotency_in_progress`)",
            413: "body too large (`body_too_large`), or an init image over the size limit "
            "(`image_too_large`)",
            422: "invalid input (`validation_error`, with `errors`; `invalid_image`, "
            "`invalid_init_candidate` for a goal's init image), or an Idempotency-Key "
            "reused with another body (`idempotency_key_reused`)",
            503: "the task broker (`broker_unavailable`) or the database "
            "(`database_unavailable`) is unavailable; retry"}
    return {code: {"description": text[code], "model": ErrorOut} for code in {*codes, 422, 503}}


def _goal_or_404(store: StoreDep, goal_id: str) -> GoalOut:
    state = store.get_state(goal_id)
    if state is None:
        raise ApiError(status.HTTP_404_NOT_FOUND, "not_found", f"goal {goal_id} not found")
    return GoalOut.of(state.goal, state)


def _rejected(exc: IterationRejected) -> ApiError:
    return ApiError(status.HTTP_409_CONFLICT, exc.code, str(exc))


GOAL_EXAMPLES = {
    "embedded": {"summary": "a small goal on the built-in shapes model",
                 "value": {"goal": "a red circle and a blue square", "budget": 8}},
    "external": {"summary": "the caller writes the prompts (reviser 'external')",
                 "value": {"goal": "a red circle", "budget": 4, "reviser": "external",
                           "tenant": "acme"}},
}
ITERATION_EXAMPLES = {
    "prompts": {"summary": "two prompts, one with a fixed seed",
                "value": {"prompts": [{"prompt": "a red circle, flat colours", "seed": 7},
                                      {"prompt": "a crimson disc on white"}]}},
}


@router.post(
    "/goals", status_code=status.HTTP_201_CREATED, response_model=GoalOut,
    responses=_answers(400, 409, 413), tags=["goals"], operation_id="create_goal",
    summary="Create a goal",
)
def create_goal(
    body: Annotated[GoalRequest, Body(openapi_examples=GOAL_EXAMPLES)], store: StoreDep,
    dispatcher: DispatcherDep, settings: SettingsDep, idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    """Create a goal and start its loop (send an Idempotency-Key to make retries safe)."""
    try:
        checked = check_goal(body, settings)
    except GoalInvalid as exc:
        raise RequestValidationError(
            [{"loc": ("body", f), "msg": m, "type": "value_error"} for f, m in exc.errors]
        ) from None

    def work(claim: IdempotencyClaim | None) -> tuple[int, Any]:
        spec = with_parsed_parts(_with_init_image(checked, body, store, settings), settings)
        goal = store.create_goal(spec, claim, webhook_of(spec, body, settings))
        try:
            dispatcher.advance_goal(goal.id)
        except Exception as exc:  # noqa: BLE001 - the broker is down: fail the goal, say so
            fail_goal(store, goal.id, f"could not dispatch: {type(exc).__name__}: {exc}")
            raise ApiError(
                status.HTTP_503_SERVICE_UNAVAILABLE, "broker_unavailable",
                "the task broker is unavailable; goal marked failed",
            ) from None
        return status.HTTP_201_CREATED, GoalOut.of(goal).model_dump(mode="json")

    scope = f"{checked.tenant}|POST /v1/goals"
    return run_once(store, settings, scope, idempotency_key,
                    request_hash(body.model_dump(mode="json")), work)


def _with_init_image(
    spec: GoalSpec, body: GoalRequest, store: StoreDep, settings: SettingsDep
) -> GoalSpec:
    """The spec with the goal's init image stored (an upload) or found (an earlier
    candidate's); 422 (`invalid_image`, `invalid_init_candidate`) or 413 (`image_too_large`)
    when it cannot be."""
    from agentloop.images import InitImageInvalid, resolve_init

    try:
        return resolve_init(spec, store, settings, body.init_image, body.init_candidate_id)
    except InitImageInvalid as exc:
        raise ApiError(exc.status, exc.code, f"{exc.field}: {exc.message}",
                       field=exc.field) from None


@router.get(
    "/goals", response_model=list[GoalOut], tags=["goals"], operation_id="list_goals",
    summary="List goals, newest first",
    responses={200: {"description": "a page of goals", "headers": PAGE_HEADERS},
               **_answers()},
)
def list_goals(
    store: StoreDep, request: Request, response: Response,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    tenant: TenantName | None = None,
    status_: Annotated[list[GoalStatus] | None, Query(alias="status")] = None,
    cursor: Annotated[str | None, Query(pattern=GOAL_CURSOR,
                                        description="the previous page's X-Next-Cursor")] = None,
) -> list[GoalOut]:
    """A page of goals, newest first, each with its summary; filter by tenant and status."""
    after = goal_position(cursor) if cursor else None
    goals = store.list_goals_page(limit + 1, tenant, [s.value for s in status_ or ()], after)
    page, more = goals[:limit], len(goals) > limit
    summaries = store.goal_summaries(page)
    if more:
        last = page[-1]
        assert last.created_at is not None  # set on insert
        set_next(response, request, goal_cursor(last.created_at, last.id))
    return [GoalOut.summary(g, *summaries[g.id]) for g in page]


@router.get(
    "/goals/{goal_id}", response_model=GoalOut, responses=_answers(404), tags=["goals"],
    operation_id="get_goal", summary="Get a goal",
)
def get_goal(goal_id: GoalId, store: StoreDep) -> GoalOut:
    """A goal with its iterations and best candidate."""
    return _goal_or_404(store, goal_id)


@router.get(
    "/goals/{goal_id}/candidates", response_model=list[CandidateOut], tags=["candidates"],
    operation_id="list_candidates", summary="List a goal's candidates",
    responses={200: {"description": "a page of candidates", "headers": PAGE_HEADERS},
               **_answers(404)},
)
def list_candidates(
    goal_id: GoalId, store: StoreDep, request: Request, response: Response,
    limit: Annotated[int, Query(ge=1, le=1000)] = 500,
    iteration: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    status_: Annotated[list[CandidateStatus] | None, Query(alias="status")] = None,
    cursor: Annotated[str | None, Query(pattern=CANDIDATE_CURSOR,
                                        description="the previous page's X-Next-Cursor")] = None,
) -> list[CandidateOut]:
    """A page of a goal's candidates in iteration order; filter by iteration and status."""
    after = candidate_position(cursor) if cursor else None
    if store.get_goal(goal_id) is None:
        raise ApiError(status.HTTP_404_NOT_FOUND, "not_found", f"goal {goal_id} not found")
    cands = store.list_candidates_page(
        goal_id, limit + 1, iteration, [s.value for s in status_ or ()], after
    )
    page = cands[:limit]
    if len(cands) > limit:
        set_next(response, request, candidate_cursor(page[-1].iteration, page[-1].ordinal))
    return [CandidateOut.of(c) for c in page]


@router.post(
    "/goals/{goal_id}/iterations", status_code=status.HTTP_201_CREATED,
    response_model=IterationAccepted, responses=_answers(400, 404, 409, 413),
    tags=["iterations"], operation_id="add_iteration", summary="Supply an iteration's prompts",
)
def add_iteration(
    goal_id: GoalId, body: Annotated[IterationIn, Body(openapi_examples=ITERATION_EXAMPLES)],
    store: StoreDep, dispatcher: DispatcherDep, settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    """Supply the next iteration's prompts (goals with reviser 'external')."""
    goal = _goal_or_404(store, goal_id)
    n_done = goal.generations_reserved
    drafts = [
        CandidateDraft(
            prompt=p.prompt,
            seed=p.seed if p.seed is not None else derive_seed(goal.spec["seed"], n_done, i),
            negative_prompt=p.negative_prompt if p.negative_prompt is not None
            else goal.spec["negative_prompt"],
            edit="external",
            variation_seed=p.variation_seed,
            variation_strength=p.variation_strength,
            regions=tuple(layout_entry(r.prompt, r.x, r.y, r.scale) for r in p.regions),
        )
        for i, p in enumerate(body.prompts)
    ]

    def work(claim: IdempotencyClaim | None) -> tuple[int, Any]:
        try:
            decision = submit_iteration(store, goal_id, drafts, claim)
        except IterationRejected as exc:
            raise _rejected(exc) from None
        assert decision is not None and decision.model is not None
        index = len(goal.iterations)
        try:
            dispatch_generation(dispatcher, decision.model, decision.dispatch,
                                settings.generation_batch)
        except Exception:  # noqa: BLE001 - the broker is down: take the prompts back if we can
            if store.withdraw_iteration(goal_id, index):
                raise ApiError(
                    status.HTTP_503_SERVICE_UNAVAILABLE, "broker_unavailable",
                    "the task broker is unavailable; the prompts were not accepted, send them "
                    "again",
                ) from None
            # a worker already has some of them (the sweep sent them): they are accepted
        else:
            store.mark_dispatched(decision.dispatch)
        accepted = IterationAccepted(goal_id=goal_id, iteration=index,
                                     candidate_ids=decision.dispatch)
        return status.HTTP_201_CREATED, accepted.model_dump(mode="json")

    scope = f"{goal.tenant}|POST /v1/goals/{goal_id}/iterations"
    return run_once(store, settings, scope, idempotency_key,
                    request_hash(goal_id, body.model_dump(mode="json")), work)


@router.post(
    "/goals/{goal_id}/close", response_model=GoalOut, responses=_answers(404, 409),
    tags=["goals"], operation_id="close_goal", summary="Close a waiting goal",
)
def close(goal_id: GoalId, store: StoreDep) -> GoalOut:
    """End a goal that waits for its caller's prompts."""
    _goal_or_404(store, goal_id)
    try:
        close_goal(store, goal_id)
    except IterationRejected as exc:
        raise _rejected(exc) from None
    return _goal_or_404(store, goal_id)


@router.post(
    "/goals/{goal_id}/cancel", response_model=GoalOut, responses=_answers(404, 409),
    tags=["goals"], operation_id="cancel_goal", summary="Cancel a goal",
)
def cancel(goal_id: GoalId, store: StoreDep) -> GoalOut:
    """Cancel an unfinished goal: nothing more of it is generated (idempotent)."""
    _goal_or_404(store, goal_id)
    try:
        cancel_goal(store, goal_id)
    except IterationRejected as exc:
        raise _rejected(exc) from None
    return _goal_or_404(store, goal_id)


@router.get(
    "/goals/{goal_id}/events", response_model=None,
    responses={200: {
        "model": list[EventOut],
        "description": "the goal's events: Server-Sent Events (`id:` the event id, `event:` its "
        "type, `data:` the event as JSON), or with `stream=false` a JSON list",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }, **_answers(404)},
    tags=["events"], operation_id="goal_events", summary="Follow a goal's events",
)
def goal_events(
    goal_id: GoalId, store: StoreDep, settings: SettingsDep,
    after: Annotated[int, Query(ge=0, description="only events with a larger id")] = 0,
    stream: Annotated[bool, Query(description="false: a JSON list instead of a stream")] = True,
    limit: Annotated[int, Query(ge=1, le=1000, description="most events in a JSON list")] = 1000,
    last_event_id: Annotated[int, Header(
        ge=0, description="resume after this event (what an EventSource sends on reconnect)",
    )] = 0,
) -> Any:
    """The goal's events, live (Server-Sent Events until `goal.finished`) or as a list."""
    if store.get_goal(goal_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"goal {goal_id} not found")
    after = max(after, last_event_id)  # both say "seen up to": the later one
    if not stream:
        return [EventOut.of(e) for e in store.events_after(goal_id, after, limit)]
    return EventSourceResponse(
        event_stream(store, goal_id, after, settings.events_poll_seconds),
        ping=settings.events_ping_seconds,
    )


async def event_stream(
    store: StoreDep, goal_id: str, after: int, poll_seconds: float
) -> AsyncIterator[Any]:
    """A goal's events after `after` as SSE messages, read from the events table every
    `poll_seconds`, until its `goal.finished` has been sent."""
    finished = await run_in_threadpool(store.finished_event_id, goal_id)
    if finished is not None and finished <= after:
        return  # the caller has seen the end already
    while True:
        events = await run_in_threadpool(store.events_after, goal_id, after, 500)
        for e in events:
            yield ServerSentEvent(
                data=EventOut.of(e).model_dump_json(), event=e.type, id=str(e.id)
            )
            after = e.id
            if e.type == "goal.finished":
                return
        if len(events) < 500:
            await anyio.sleep(poll_seconds)


@router.get(
    "/goals/{goal_id}/webhook-deliveries", response_model=list[WebhookDeliveryOut],
    responses=_answers(404), tags=["webhooks"], operation_id="list_webhook_deliveries",
    summary="List a goal's webhook deliveries",
)
def list_webhook_deliveries(goal_id: GoalId, store: StoreDep) -> list[WebhookDeliveryOut]:
    """Each event sent (or to be sent) to the goal's webhook, with its attempts and outcome."""
    if store.get_goal(goal_id) is None:
        raise ApiError(status.HTTP_404_NOT_FOUND, "not_found", f"goal {goal_id} not found")
    return [WebhookDeliveryOut.of(d) for d in store.webhook_deliveries(goal_id)]


@router.get(
    "/artifacts/{goal_id}/{name}", response_class=FileResponse,
    responses={200: {"content": {"image/png": {}}, "description": "a PNG"}, **_answers(404)},
    tags=["artifacts"], operation_id="get_artifact", summary="Get an image",
)
def get_artifact(goal_id: GoalId, name: ArtifactName, settings: SettingsDep) -> FileResponse:
    """A generated image."""
    root = settings.resolved_artifacts_dir()
    path = (root / goal_id / name).resolve()
    if root not in path.parents or not path.is_file() or path.suffix != ".png":
        raise ApiError(status.HTTP_404_NOT_FOUND, "not_found", "artifact not found")
    return FileResponse(Path(path), media_type="image/png")


@router.get(
    "/models", response_model=ModelsOut, responses=_answers(), tags=["models"],
    operation_id="list_models", summary="List the models and scorers",
)
def list_models(settings: SettingsDep) -> ModelsOut:
    """The models and scorers this installation knows, and the defaults a goal gets."""
    from engine.catalog import is_known_model, is_known_scorer, known_models, known_scorers

    extra = tuple(settings.extra_models)
    # The same fallback check_goal applies when the configured default is not installed.
    model = settings.default_model if is_known_model(settings.default_model, extra) else "tiny-dit"
    scorer = settings.default_scorer if is_known_scorer(settings.default_scorer) else "tiny-clip"
    return ModelsOut(
        models=known_models(extra), scorers=known_scorers(), default_model=model,
        default_scorer=scorer,
        revisers=available_revisers(settings),
    )
