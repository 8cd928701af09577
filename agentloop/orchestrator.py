"""The orchestrator: an idempotent step function over the goal's state in the database.

`advance(store, goal_id)` locks the goal, reads its scored history, and decides: wait for the
open iteration, close it, stop, or have the reviser propose the next candidates. A duplicate
call finds the truth in the database and changes nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from agentloop.domain import (
    CandidateDraft,
    CandidateStatus,
    CandidateView,
    Decision,
    GoalState,
    GoalStatus,
    IterationStatus,
    Reclaim,
    StopReason,
    finishing,
    generation_cost,
    prune_problems,
)
from agentloop.llm import LlmConfig
from agentloop.parts import parts_of
from agentloop.revisers import Proposal, Reviser, ReviserContext, get_reviser, objective
from agentloop.settings import Settings
from agentloop.store import IdempotencyClaim, Store, utcnow

log = logging.getLogger(__name__)


class IterationRejected(ValueError):
    """Prompts supplied for an external goal cannot be accepted now (state or budget), or the
    goal cannot be closed or cancelled in its state. `code` names the reason, stably:
    `not_external`, `goal_not_waiting`, `iteration_open`, `budget_exceeded`, `goal_finished`."""

    def __init__(self, message: str, code: str = "conflict"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Policy:
    """Orchestrator knobs that come from the settings (see `Settings` for each)."""

    outbox_grace_seconds: float = 5.0
    redispatch_after_seconds: float = 60.0
    max_attempts: int = 3
    idle_queues: frozenset[str] = frozenset()
    """Models whose generation queue the sweep saw empty: a candidate of theirs sent over
    `outbox_grace_seconds` ago and still queued lost its message."""
    llm: LlmConfig | None = None
    """The endpoint the `llm` reviser asks (None: none configured; it falls back to search)."""
    goal_parser: str = "rules"
    """The goal parser that splits goals into parts (`agentloop.parts`)."""

    @classmethod
    def of(cls, settings: Settings) -> Policy:
        return cls(
            outbox_grace_seconds=settings.outbox_grace_seconds,
            redispatch_after_seconds=settings.redispatch_after_seconds,
            max_attempts=settings.max_attempts,
            llm=LlmConfig.of(settings),
            goal_parser=settings.goal_parser,
        )


Proposals = dict[Hashable, Proposal]
"""Proposals already made, by the fingerprint of the context they were made for."""


class RemoteProposalNeeded(Exception):
    """Raised by `step(..., defer_remote=True)` instead of asking a remote reviser under the
    goal's lock: the caller asks it (`reviser.propose(ctx)`) and steps again."""

    def __init__(self, reviser: Reviser, ctx: ReviserContext, key: Hashable):
        super().__init__(f"reviser {reviser.name} is asked outside the goal's lock")
        self.reviser, self.ctx, self.key = reviser, ctx, key


def step(
    state: GoalState, policy: Policy, now: datetime, proposals: Proposals | None = None,
    defer_remote: bool = False,
) -> Decision:
    """Decide the goal's next move from its state. Pure: no I/O, but for what the reviser
    does (a remote reviser asks a service). A proposal found in `proposals` for the same
    context is used instead of asking the reviser; with `defer_remote`, a remote reviser is
    not asked but RemoteProposalNeeded raised."""
    goal, spec = state.goal, state.goal.spec
    d = Decision()
    d.reclaim = _expired_leases(state, policy, now)
    if goal.status.terminal:
        return d
    taken_back = {r.candidate_id: r for r in d.reclaim}
    structured = parts_of(spec.goal, spec.parts, policy.goal_parser)
    parts = tuple(p.text for p in structured)
    open_it = next((it for it in state.iterations if it.status is IterationStatus.OPEN), None)
    if open_it is not None:
        cands = [
            replace(c, status=taken_back[c.id].status, error=taken_back[c.id].error)
            if c.id in taken_back else c
            for c in state.of_iteration(open_it.index)
        ]
        unfinished = [c for c in cands if not c.status.terminal]
        if unfinished:
            d.redispatch = [c.id for c in unfinished if _unsent(c, policy, now)]
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
    left = goal.budget - goal.generations_reserved
    n = min(spec.fanout, left)
    reviser = get_reviser(spec.reviser, policy.llm)
    index = max((it.index for it in state.iterations), default=-1) + 1
    ctx = ReviserContext(spec, parts, index, n, state.candidates, left,
                         goal_parts=structured)
    key = _fingerprint(state.goal.id, ctx)
    proposal = proposals.get(key) if proposals is not None else None
    if proposal is None:
        if defer_remote and getattr(reviser, "remote", False):
            raise RemoteProposalNeeded(reviser, ctx, key)
        proposal, error = _propose(reviser, ctx)
        if proposal is None:
            d.goal_status, d.stop_reason = GoalStatus.FAILED, StopReason.REVISER_FAILED.value
            d.error = error
            return d
    if not proposal.candidates:
        if goal.status is not GoalStatus.WAITING:
            d.goal_status = GoalStatus.WAITING
        return d
    d.new_candidates, d.notes = _fit(proposal.candidates, n, left, spec.steps), proposal.notes
    if goal.status is not GoalStatus.RUNNING:
        d.goal_status = GoalStatus.RUNNING
    return d


def _propose(reviser: Reviser, ctx: ReviserContext) -> tuple[Proposal | None, str | None]:
    """The reviser's proposal, or (None, why). A reviser is deterministic, so one that raises
    would raise again on every retry and leave the goal stuck: a reviser other than ``search``
    is replaced by ``search`` for this iteration (its notes say why); when ``search`` raises
    too, the goal fails with the error."""
    errors: list[str] = []
    chain = (reviser,) if reviser.name == "search" else (reviser, get_reviser("search"))
    for candidate in chain:
        try:
            proposal = candidate.propose(ctx)
        except Exception as exc:  # noqa: BLE001 - a bug or a plug-in's failure, recorded
            log.exception("reviser %s raised on goal %r", candidate.name, ctx.spec.goal)
            errors.append(f"reviser {candidate.name} raised {type(exc).__name__}: {exc}")
            continue
        if errors:
            proposal.notes = {**proposal.notes, "fallback": "search", "reviser_error": errors[0]}
        return proposal, None
    return None, "; ".join(errors)


def _fit(drafts: list[CandidateDraft], n: int, left: int, steps: int) -> list[CandidateDraft]:
    """The proposal as it can run: whole when at most ``n`` of it finish, its cost fits the
    budget left and its prune groups are sound; else its first ``n`` drafts, unpruned."""
    if (finishing(drafts) <= n and generation_cost(drafts, steps) <= left
            and not prune_problems(drafts, steps)):
        return drafts
    return [d.unpruned() for d in drafts[:n]]


def _expired_leases(state: GoalState, policy: Policy, now: datetime) -> list[Reclaim]:
    """Running candidates whose worker stopped renewing its lease (it died, or lost the
    database): requeued while attempts remain, failed on the last one, cancelled if the goal
    has ended meanwhile."""
    reclaims = []
    for c in state.candidates:
        if c.status is not CandidateStatus.RUNNING or c.claim_token is None:
            continue
        if c.lease_expires_at is None or c.lease_expires_at >= now:
            continue
        lost = f"worker {c.worker} stopped renewing its lease (attempt {c.attempts})"
        if state.goal.status.terminal:
            status, error = CandidateStatus.CANCELLED, f"goal ended; {lost}"
        elif c.attempts < policy.max_attempts:
            status, error = CandidateStatus.QUEUED, f"{lost}; retrying"
        else:
            status, error = CandidateStatus.FAILED, f"{lost}; no attempts left"
        reclaims.append(Reclaim(c.id, c.claim_token, status, error))
    return reclaims


def _unsent(c: CandidateView, policy: Policy, now: datetime) -> bool:
    """A queued candidate whose message was never sent (the outbox's grace has passed), or was
    sent so long ago that it must have been lost."""
    if c.status is not CandidateStatus.QUEUED:
        return False
    grace = now - timedelta(seconds=policy.outbox_grace_seconds)
    if c.dispatched_at is None:
        return c.queued_at is None or c.queued_at < grace
    if c.params.get("model") in policy.idle_queues and c.dispatched_at < grace:
        return True
    return c.dispatched_at < now - timedelta(seconds=policy.redispatch_after_seconds)


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


def _fingerprint(goal_id: str, ctx: ReviserContext) -> Hashable:
    """What a proposal depends on: the goal, the iteration, its size, and the history."""
    return (goal_id, ctx.iteration, ctx.n, tuple(
        (c.id, c.status.value, c.clip_score, tuple(sorted(c.part_scores.items())))
        for c in ctx.history))


_asking: dict[Hashable, Future[Proposal]] = {}
_asking_lock = threading.Lock()


def _ask_once(need: RemoteProposalNeeded) -> Proposal:
    """Ask a remote reviser, unless a thread of this process is asking it for the same
    context already (the sweep advancing a goal whose model is still thinking): then wait
    for that answer instead of paying for a second one."""
    with _asking_lock:
        pending = _asking.get(need.key)
        if pending is None:
            mine: Future[Proposal] = Future()
            _asking[need.key] = mine
    if pending is not None:
        return pending.result()
    try:
        proposal = need.reviser.propose(need.ctx)
        mine.set_result(proposal)
        return proposal
    except BaseException as exc:
        mine.set_exception(exc)
        raise
    finally:
        with _asking_lock:
            _asking.pop(need.key, None)


def advance(store: Store, goal_id: str, policy: Policy | None = None) -> Decision | None:
    """One orchestrator step for a goal, in one transaction. None if the goal does not exist.

    A remote reviser (the `llm` one) is never asked under the goal's lock (on SQLite the
    write lock is the whole database's, and a model may think for a minute): the step that
    needs it rolls back, the reviser is asked outside any transaction, and the step runs
    again with that proposal. Should the goal change meanwhile (another step, a reclaimed
    candidate) so that the proposal no longer fits, it is asked again; after three tries,
    under the lock.
    """
    policy = policy or Policy()
    proposals: Proposals = {}
    for _ in range(3):
        try:
            return store.decide(goal_id, lambda state: step(
                state, policy, state.now or utcnow(), proposals, defer_remote=True))
        except RemoteProposalNeeded as need:
            proposals[need.key] = _ask_once(need)
    return store.decide(
        goal_id, lambda state: step(state, policy, state.now or utcnow(), proposals)
    )


def submit_iteration(
    store: Store, goal_id: str, drafts: list[CandidateDraft],
    claim: IdempotencyClaim | None = None,
) -> Decision | None:
    """Accept a caller's prompts as the next iteration of an external goal (recording the
    idempotency `claim`, if any, in the same transaction)."""

    def decide(state: GoalState) -> Decision:
        goal = state.goal
        if goal.spec.reviser != "external":
            raise IterationRejected("this goal's reviser is not 'external'", "not_external")
        if any(it.status is IterationStatus.OPEN for it in state.iterations):
            raise IterationRejected("the previous iteration is still running", "iteration_open")
        if goal.status not in (GoalStatus.PENDING, GoalStatus.WAITING):
            code = "goal_finished" if goal.status.terminal else "goal_not_waiting"
            raise IterationRejected(
                f"goal is {goal.status.value}; it accepts prompts when waiting", code
            )
        left = goal.budget - goal.generations_reserved
        if len(drafts) > left:
            raise IterationRejected(
                f"{len(drafts)} prompts exceed the {left} generations left", "budget_exceeded"
            )
        return Decision(
            new_candidates=drafts, goal_status=GoalStatus.RUNNING,
            notes={"strategy": "external", "supplied": len(drafts)},
        )

    return store.decide(goal_id, decide, claim)


def close_goal(store: Store, goal_id: str) -> Decision | None:
    """The caller ends a goal that is waiting for its prompts."""

    def decide(state: GoalState) -> Decision:
        status = state.goal.status
        if status is not GoalStatus.WAITING:
            code = "goal_finished" if status.terminal else "goal_not_waiting"
            raise IterationRejected(
                f"goal is {status.value}; only a waiting goal can be closed", code
            )
        return Decision(goal_status=GoalStatus.DONE, stop_reason=StopReason.CLOSED_BY_CALLER.value)

    return store.decide(goal_id, decide)


def cancel_goal(store: Store, goal_id: str) -> Decision | None:
    """End a goal that has not finished, in one transaction: the goal becomes cancelled, its
    queued candidates are cancelled, its open iteration closed. Running candidates may finish
    but are never claimed again. Cancelling a cancelled goal changes nothing."""

    def decide(state: GoalState) -> Decision:
        status = state.goal.status
        if status is GoalStatus.CANCELLED:
            return Decision()
        if status.terminal:
            raise IterationRejected(
                f"goal is {status.value}; only an unfinished goal can be cancelled", "goal_finished"
            )
        return Decision(goal_status=GoalStatus.CANCELLED,
                        stop_reason=StopReason.CANCELLED_BY_CALLER.value)

    return store.decide(goal_id, decide)


def fail_goal(store: Store, goal_id: str, error: str) -> Decision | None:
    """Mark a goal that has not finished as failed (e.g. its first task could not be sent)."""

    def decide(state: GoalState) -> Decision:
        if state.goal.status.terminal:
            return Decision()
        return Decision(goal_status=GoalStatus.FAILED, stop_reason=StopReason.DISPATCH_FAILED.value,
                        error=error)

    return store.decide(goal_id, decide)
