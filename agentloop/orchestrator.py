"""The orchestrator: an idempotent step function over the goal's state in the database.

`advance(store, goal_id)` locks the goal, reads its scored history, and decides: wait for the
open iteration, close it, stop, or have the reviser propose the next candidates. A duplicate
call finds the truth in the database and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from agentloop.domain import (
    CandidateDraft,
    CandidateStatus,
    Decision,
    GoalState,
    GoalStatus,
    IterationStatus,
    StopReason,
    split_parts,
)
from agentloop.revisers import ReviserContext, get_reviser, objective
from agentloop.store import Store, utcnow


class IterationRejected(ValueError):
    """Prompts supplied for an external goal cannot be accepted now (state or budget)."""


@dataclass(frozen=True)
class Policy:
    """Orchestrator knobs that come from the settings."""

    redispatch_after_seconds: float = 600.0


def step(state: GoalState, policy: Policy, now: datetime) -> Decision:
    """Decide the goal's next move from its state. Pure: no I/O."""
    goal, spec = state.goal, state.goal.spec
    d = Decision()
    if goal.status.terminal:
        return d
    parts = split_parts(spec.goal)
    open_it = next((it for it in state.iterations if it.status is IterationStatus.OPEN), None)
    if open_it is not None:
        cands = state.of_iteration(open_it.index)
        unfinished = [c for c in cands if not c.status.terminal]
        if unfinished:
            stale = now - timedelta(seconds=policy.redispatch_after_seconds)
            d.redispatch = [
                c.id for c in unfinished
                if c.status is CandidateStatus.QUEUED and c.queued_at and c.queued_at < stale
            ]
            return d
        d.close_iteration = open_it.index
        scores = [c.clip_score for c in cands if c.clip_score is not None]
        d.iteration_best = max(scores) if scores else None
        if not scores:
            errors = [c.error for c in cands if c.error]
            d.goal_status, d.stop_reason = GoalStatus.FAILED, StopReason.GENERATION_FAILED.value
            d.error = errors[0] if errors else "every generation of the iteration failed"
            return d
    done = [c for c in state.candidates if c.status is CandidateStatus.SUCCEEDED]
    if done:
        best = max(done, key=lambda c: (objective(c, parts), -c.iteration, -c.ordinal))
        if best.id != goal.best_candidate_id:
            d.best = (best.id, float(best.clip_score or 0.0))
    stop = _stop_reason(state, parts, d)
    if stop is not None:
        d.goal_status, d.stop_reason = GoalStatus.DONE, stop.value
        return d
    n = min(spec.fanout, goal.budget - goal.generations_reserved)
    reviser = get_reviser(spec.reviser)
    index = max((it.index for it in state.iterations), default=-1) + 1
    proposal = reviser.propose(ReviserContext(spec, parts, index, n, state.candidates))
    if not proposal.candidates:
        if goal.status is not GoalStatus.WAITING:
            d.goal_status = GoalStatus.WAITING
        return d
    d.new_candidates, d.notes = proposal.candidates[:n], proposal.notes
    if goal.status is not GoalStatus.RUNNING:
        d.goal_status = GoalStatus.RUNNING
    return d


def _stop_reason(state: GoalState, parts: tuple[str, ...], d: Decision) -> StopReason | None:
    goal, spec = state.goal, state.goal.spec
    best_score = d.best[1] if d.best else goal.best_score
    if spec.target_score is not None and best_score is not None and best_score >= spec.target_score:
        return StopReason.TARGET_REACHED
    if goal.generations_reserved >= goal.budget:
        return StopReason.BUDGET_SPENT
    closed = sorted(
        {it.index for it in state.iterations if it.status is IterationStatus.CLOSED}
        | ({d.close_iteration} if d.close_iteration is not None else set())
    )
    if len(closed) >= spec.max_iterations:
        return StopReason.MAX_ITERATIONS
    if len(closed) > spec.patience and _iterations_since_improvement(state, parts, closed) >= spec.patience:
        return StopReason.NO_IMPROVEMENT
    return None


def _iterations_since_improvement(
    state: GoalState, parts: tuple[str, ...], closed: list[int]
) -> int:
    best = float("-inf")
    since = 0
    for index in closed:
        scores = [objective(c, parts) for c in state.of_iteration(index)
                  if c.status is CandidateStatus.SUCCEEDED]
        top = max(scores, default=float("-inf"))
        if top > best + 1e-6:
            best, since = top, 0
        else:
            since += 1
    return since


def advance(store: Store, goal_id: str, policy: Policy | None = None) -> Decision | None:
    """One orchestrator step for a goal, in one transaction. None if the goal does not exist."""
    policy = policy or Policy()
    return store.decide(goal_id, lambda state: step(state, policy, utcnow()))


def submit_iteration(store: Store, goal_id: str, drafts: list[CandidateDraft]) -> Decision | None:
    """Accept a caller's prompts as the next iteration of an external goal."""

    def decide(state: GoalState) -> Decision:
        goal = state.goal
        if goal.spec.reviser != "external":
            raise IterationRejected("this goal's reviser is not 'external'")
        if goal.status not in (GoalStatus.PENDING, GoalStatus.WAITING):
            raise IterationRejected(f"goal is {goal.status.value}; it accepts prompts when waiting")
        if any(it.status is IterationStatus.OPEN for it in state.iterations):
            raise IterationRejected("the previous iteration is still running")
        left = goal.budget - goal.generations_reserved
        if len(drafts) > left:
            raise IterationRejected(f"{len(drafts)} prompts exceed the {left} generations left")
        return Decision(
            new_candidates=drafts, goal_status=GoalStatus.RUNNING,
            notes={"strategy": "external", "supplied": len(drafts)},
        )

    return store.decide(goal_id, decide)


def close_goal(store: Store, goal_id: str) -> Decision | None:
    """The caller ends a goal that is waiting for its prompts."""

    def decide(state: GoalState) -> Decision:
        if state.goal.status is not GoalStatus.WAITING:
            raise IterationRejected(f"goal is {state.goal.status.value}; only a waiting goal can be closed")
        return Decision(goal_status=GoalStatus.DONE, stop_reason=StopReason.CLOSED_BY_CALLER.value)

    return store.decide(goal_id, decide)


def fail_goal(store: Store, goal_id: str, error: str) -> Decision | None:
    """Mark a goal that has not finished as failed (e.g. its first task could not be sent)."""

    def decide(state: GoalState) -> Decision:
        if state.goal.status.terminal:
            return Decision()
        return Decision(goal_status=GoalStatus.FAILED, stop_reason=StopReason.DISPATCH_FAILED.value,
                        error=error)

    return store.decide(goal_id, decide)
