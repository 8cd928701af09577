"""The task functions. Celery tasks and the in-process dispatcher both run exactly these."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentloop.dispatch import Dispatcher, dispatch_generation
from agentloop.domain import CandidateStatus, CandidateView, split_parts
from agentloop.orchestrator import Policy, advance
from agentloop.settings import Settings
from agentloop.store import Store
from engine.types import GenerationRequest, Region, ScoreRequest
from workers.residency import Residency

if TYPE_CHECKING:
    from engine.runner import Runner

log = logging.getLogger(__name__)


def default_worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class WorkerContext:
    """What a task function needs; one per process (or per embedded run)."""

    store: Store
    dispatcher: Dispatcher
    settings: Settings
    residency: Residency | None = None
    worker_name: str = ""

    def __post_init__(self) -> None:
        self.worker_name = self.worker_name or self.settings.worker_name or default_worker_name()


def advance_goal_job(ctx: WorkerContext, goal_id: str) -> list[str]:
    """One orchestrator step; dispatches the candidates it created. Returns their ids."""
    policy = Policy(redispatch_after_seconds=ctx.settings.redispatch_after_seconds)
    decision = advance(ctx.store, goal_id, policy)
    if decision is None:
        log.warning("advance_goal: goal %s does not exist", goal_id)
        return []
    if decision.dispatch and decision.model:
        dispatch_generation(ctx.dispatcher, decision.model, decision.dispatch, ctx.settings.generation_batch)
    return decision.dispatch


def generate_job(ctx: WorkerContext, candidate_ids: Sequence[str]) -> list[str]:
    """Claim, generate, score and record candidates; then re-trigger the orchestrator.

    Idempotent by candidate id: a candidate already claimed or finished is skipped.
    Returns the ids this call completed.
    """
    s = ctx.settings
    claimed = ctx.store.claim_candidates(candidate_ids, ctx.worker_name, s.lease_seconds, s.max_attempts)
    completed: list[str] = []
    if claimed:
        try:
            completed = _generate_and_record(ctx, claimed)
        except Exception as exc:  # noqa: BLE001 - recorded on the candidates, then retried
            log.exception("generation failed for %d candidates", len(claimed))
            _release(ctx, claimed, f"{type(exc).__name__}: {exc}")
    goal_ids = {c.goal_id for c in claimed} or {c.goal_id for c in ctx.store.get_candidates(candidate_ids)}
    for goal_id in sorted(goal_ids):
        ctx.dispatcher.advance_goal(goal_id)
    return completed


def _generate_and_record(ctx: WorkerContext, claimed: list[CandidateView]) -> list[str]:
    """Generate and score claimed candidates, which may belong to several goals and models."""
    residency = ctx.residency or Residency()
    ctx.residency = residency
    texts = {gid: _goal_text(ctx, gid) for gid in {c.goal_id for c in claimed}}
    done: list[str] = []
    by_model: dict[tuple[str, str], list[CandidateView]] = {}
    for c in claimed:
        by_model.setdefault((c.params["model"], c.params["scorer"]), []).append(c)
    for (model, scorer), claimed_group in by_model.items():
        with residency.lock:
            runner = residency.runner(model)
            group, requests = _refuse_invalid(ctx, runner, claimed_group)
            if not group:
                continue
            score_requests = [ScoreRequest(texts[c.goal_id], split_parts(texts[c.goal_id])) for c in group]
            t0 = time.perf_counter()
            results = runner.generate(requests)
            t1 = time.perf_counter()
            scores = residency.scorer(scorer).score([r.image for r in results], score_requests)
            t2 = time.perf_counter()
        shared = {"generate_batch_s": t1 - t0, "score_s": (t2 - t1) / len(results),
                  "batch_size": float(len(results))}
        for cand, result, score in zip(group, results, scores, strict=True):
            uri = _save_png(ctx.settings.resolved_artifacts_dir(), cand, result.image)
            if ctx.store.complete_candidate(
                cand.id, ctx.worker_name, clip_score=score.clip_score,
                part_scores=score.part_scores, artifact_uri=uri, timings={**result.timings, **shared},
            ):
                done.append(cand.id)
    return done


def _refuse_invalid(
    ctx: WorkerContext, runner: Runner, group: list[CandidateView]
) -> tuple[list[CandidateView], list[GenerationRequest]]:
    """The candidates the runner can serve, with their requests. Each one it refuses (a layout
    for a model that cannot draw one, say) fails at once with the runner's reason: retrying
    the same request cannot help, and it must not take its batch neighbours down with it."""
    kept: list[CandidateView] = []
    requests: list[GenerationRequest] = []
    for c in group:
        request = _request(c)
        try:
            runner.validate(request)
        except ValueError as exc:
            log.warning("candidate %s refused: %s", c.id, exc)
            ctx.store.release_candidate(c.id, ctx.worker_name, f"ValueError: {exc}", max_attempts=0)
            continue
        kept.append(c)
        requests.append(request)
    return kept, requests


def _goal_text(ctx: WorkerContext, goal_id: str) -> str:
    goal = ctx.store.get_goal(goal_id)
    if goal is None:
        raise LookupError(f"goal {goal_id} vanished while its candidates were generated")
    return goal.text


def _request(c: CandidateView) -> GenerationRequest:
    """The engine request for a stored candidate, with its variation and layout if it has them."""
    return GenerationRequest(
        prompt=c.prompt, seed=c.seed, negative_prompt=c.negative_prompt,
        width=int(c.params["width"]), height=int(c.params["height"]),
        steps=int(c.params["steps"]), guidance=float(c.params["guidance"]), model=c.params["model"],
        variation_seed=c.variation_seed,
        variation_strength=c.variation_strength,
        regions=tuple(Region(*region) for region in c.regions),
    )


def _save_png(root: Path, cand: CandidateView, image) -> str:  # noqa: ANN001 - PIL image
    """Write the image atomically; return its URI relative to the artifacts root."""
    folder = root / cand.goal_id
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{cand.id}.png"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    image.save(tmp, format="PNG")
    os.replace(tmp, path)
    return f"{cand.goal_id}/{cand.id}.png"


def _release(ctx: WorkerContext, claimed: list[CandidateView], error: str) -> None:
    """Put failed candidates back for a retry (or fail them after max_attempts); re-dispatch."""
    by_model: dict[str, list[str]] = {}
    for cand in claimed:
        status = ctx.store.release_candidate(cand.id, ctx.worker_name, error, ctx.settings.max_attempts)
        if status is CandidateStatus.QUEUED:
            by_model.setdefault(cand.params["model"], []).append(cand.id)
    for model, ids in by_model.items():
        ctx.dispatcher.generate(model, ids)
