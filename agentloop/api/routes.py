"""The /v1 routes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from pydantic import Field

from agentloop.api.deps import DispatcherDep, SettingsDep, StoreDep
from agentloop.api.schemas import (
    CandidateOut,
    GoalOut,
    IterationAccepted,
    IterationIn,
    ModelsOut,
)
from agentloop.dispatch import dispatch_generation
from agentloop.domain import (
    CandidateDraft,
    GoalInvalid,
    GoalRequest,
    SafeStr,
    TenantName,
    check_goal,
)
from agentloop.orchestrator import (
    IterationRejected,
    cancel_goal,
    close_goal,
    fail_goal,
    submit_iteration,
)
from agentloop.revisers import derive_seed

router = APIRouter(prefix="/v1")

GoalId = Annotated[SafeStr, Field(max_length=64)]
"""A goal id in a path (ids are 32 hex digits; anything else storable is simply not found)."""

ArtifactName = Annotated[SafeStr, Field(max_length=255)]
"""An image's file name in a path."""


def _answers(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route gives, each `{"detail": ...}` (every
    route may answer 503 while the database is away)."""
    text = {400: "the body is not UTF-8", 404: "not found",
            409: "not possible in the goal's state", 413: "body too large",
            503: "the task broker or the database is unavailable"}
    return {code: {"description": text[code]} for code in {*codes, 503}}


def _goal_or_404(store: StoreDep, goal_id: str) -> GoalOut:
    state = store.get_state(goal_id)
    if state is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"goal {goal_id} not found")
    return GoalOut.of(state.goal, state)


@router.post(
    "/goals", status_code=status.HTTP_201_CREATED, response_model=GoalOut,
    responses=_answers(400, 413, 503),
)
def create_goal(body: GoalRequest, store: StoreDep, dispatcher: DispatcherDep, settings: SettingsDep) -> GoalOut:
    """Create a goal and start its loop."""
    try:
        spec = check_goal(body, settings)
    except GoalInvalid as exc:
        raise RequestValidationError(
            [{"loc": ("body", f), "msg": m, "type": "value_error"} for f, m in exc.errors]
        ) from None
    goal = store.create_goal(spec)
    try:
        dispatcher.advance_goal(goal.id)
    except Exception as exc:  # noqa: BLE001 - the broker is down: fail the goal, say so
        fail_goal(store, goal.id, f"could not dispatch: {type(exc).__name__}: {exc}")
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, "the task broker is unavailable; goal marked failed"
        ) from None
    return GoalOut.of(goal)


@router.get("/goals", response_model=list[GoalOut])
def list_goals(
    store: StoreDep, limit: Annotated[int, Query(ge=1, le=500)] = 50,
    tenant: TenantName | None = None,
) -> list[GoalOut]:
    """The most recent goals."""
    return [GoalOut.of(g) for g in store.list_goals(limit, tenant)]


@router.get("/goals/{goal_id}", response_model=GoalOut, responses=_answers(404))
def get_goal(goal_id: GoalId, store: StoreDep) -> GoalOut:
    """A goal with its iterations and best candidate."""
    return _goal_or_404(store, goal_id)


@router.get(
    "/goals/{goal_id}/candidates", response_model=list[CandidateOut], responses=_answers(404)
)
def list_candidates(goal_id: GoalId, store: StoreDep) -> list[CandidateOut]:
    """Every candidate of a goal, in iteration order."""
    _goal_or_404(store, goal_id)
    return [CandidateOut.of(c) for c in store.list_candidates(goal_id)]


@router.post(
    "/goals/{goal_id}/iterations", status_code=status.HTTP_201_CREATED,
    response_model=IterationAccepted, responses=_answers(400, 404, 409, 413, 503),
)
def add_iteration(
    goal_id: GoalId, body: IterationIn, store: StoreDep, dispatcher: DispatcherDep,
    settings: SettingsDep,
) -> IterationAccepted:
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
            regions=tuple((r.prompt, r.x, r.y) for r in p.regions),
        )
        for i, p in enumerate(body.prompts)
    ]
    try:
        decision = submit_iteration(store, goal_id, drafts)
    except IterationRejected as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    assert decision is not None and decision.model is not None
    index = len(goal.iterations)
    try:
        dispatch_generation(dispatcher, decision.model, decision.dispatch, settings.generation_batch)
    except Exception:  # noqa: BLE001 - the broker is down: take the prompts back if we can
        if store.withdraw_iteration(goal_id, index):
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE,
                "the task broker is unavailable; the prompts were not accepted, send them again",
            ) from None
        # a worker already has some of them (the sweep sent them): they are accepted
    else:
        store.mark_dispatched(decision.dispatch)
    return IterationAccepted(goal_id=goal_id, iteration=index, candidate_ids=decision.dispatch)


@router.post("/goals/{goal_id}/close", response_model=GoalOut, responses=_answers(404, 409))
def close(goal_id: GoalId, store: StoreDep) -> GoalOut:
    """End a goal that waits for its caller's prompts."""
    _goal_or_404(store, goal_id)
    try:
        close_goal(store, goal_id)
    except IterationRejected as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    return _goal_or_404(store, goal_id)


@router.post("/goals/{goal_id}/cancel", response_model=GoalOut, responses=_answers(404, 409))
def cancel(goal_id: GoalId, store: StoreDep) -> GoalOut:
    """Cancel an unfinished goal: nothing more of it is generated (idempotent)."""
    _goal_or_404(store, goal_id)
    try:
        cancel_goal(store, goal_id)
    except IterationRejected as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    return _goal_or_404(store, goal_id)


@router.get(
    "/artifacts/{goal_id}/{name}", response_class=FileResponse,
    responses={200: {"content": {"image/png": {}}, "description": "a PNG"}, **_answers(404)},
)
def get_artifact(goal_id: GoalId, name: ArtifactName, settings: SettingsDep) -> FileResponse:
    """A generated image."""
    root = settings.resolved_artifacts_dir()
    path = (root / goal_id / name).resolve()
    if root not in path.parents or not path.is_file() or path.suffix != ".png":
        raise HTTPException(status.HTTP_404_NOT_FOUND, "artifact not found")
    return FileResponse(Path(path), media_type="image/png")


@router.get("/models", response_model=ModelsOut, responses=_answers())
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
    )
