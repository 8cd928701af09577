"""The task functions. Celery tasks and the in-process dispatcher both run exactly these."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from agentloop.dispatch import Dispatcher, dispatch_generation, queue_depth
from agentloop.domain import SWEEP_HEARTBEAT, CandidateStatus, CandidateView
from agentloop.images import load_artifact
from agentloop.orchestrator import Policy, advance
from agentloop.parts import part_regions, parts_of
from agentloop.revisers.base import objective_of
from agentloop.settings import Settings
from agentloop.store import Outcome, Store
from engine.types import GenerationRequest, GenerationResult, Region, ScoreRequest
from workers.residency import Residency

if TYPE_CHECKING:
    from PIL import Image

    from engine.runner import PreviewScorer, Runner
    from engine.scorer import Scorer

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


def advance_goal_job(ctx: WorkerContext, goal_id: str, policy: Policy | None = None) -> list[str]:
    """One orchestrator step; sends the candidates it created or took back. Returns their ids."""
    decision = advance(ctx.store, goal_id, policy or Policy.of(ctx.settings))
    if decision is None:
        log.warning("advance_goal: goal %s does not exist", goal_id)
        return []
    if decision.dispatch and decision.model:
        send_generation(ctx, decision.model, decision.dispatch)
    return decision.dispatch


def send_generation(ctx: WorkerContext, model: str, ids: list[str]) -> None:
    """Send candidates to the generation queue, then mark them sent (the outbox's second half:
    a crash between the commit that queued them and this send is repaired by the sweep)."""
    dispatch_generation(ctx.dispatcher, model, ids, ctx.settings.generation_batch)
    ctx.store.mark_dispatched(ids)


def reconcile(ctx: WorkerContext) -> list[str]:
    """One sweep: advance every goal a lost message may have left behind (expired leases,
    unsent or lost generation messages, stalled goals). Returns the goals it advanced."""
    s = ctx.settings
    idle: set[str] = set()

    def idle_models(models: set[str]) -> set[str]:
        idle.update(m for m in models if queue_depth(ctx.dispatcher, m) == 0)
        return idle

    goal_ids = ctx.store.goals_needing_attention(
        outbox_grace=s.outbox_grace_seconds, redispatch_after=s.redispatch_after_seconds,
        stall_after=s.stall_after_seconds, idle_models=idle_models,
    )
    policy = replace(Policy.of(s), idle_queues=frozenset(idle))
    for goal_id in goal_ids:
        try:
            advance_goal_job(ctx, goal_id, policy)
        except Exception:  # noqa: BLE001 - one goal's trouble must not stop the sweep
            log.exception("sweep: advancing goal %s failed", goal_id)
    if goal_ids:
        log.info("sweep advanced %d goal(s)", len(goal_ids))
    ctx.store.beat(SWEEP_HEARTBEAT, s.sweep_interval_seconds)  # /healthz tells a stopped sweep by it
    return goal_ids


def generate_job(ctx: WorkerContext, candidate_ids: Sequence[str]) -> list[str]:
    """Claim, generate, score and record candidates; then re-trigger the orchestrator.

    Idempotent by candidate id: a candidate already claimed (lease unexpired) or finished is
    skipped. The claim's lease is renewed while the batches run. The candidates may belong to
    many goals (a worker batches across goals): first attempts run as one engine batch, and
    each candidate on a later attempt runs in a batch of its own (`engine_batches`). If a
    batch fails, each of its members is retried on its own, so one bad candidate fails alone.
    Returns the ids this call completed.
    """
    s = ctx.settings
    claimed = ctx.store.claim_candidates(candidate_ids, ctx.worker_name, s.lease_seconds, s.max_attempts)
    siblings = ctx.store.prune_siblings(claimed)  # a prune group runs whole
    if siblings:
        claimed += ctx.store.claim_candidates(
            siblings, ctx.worker_name, s.lease_seconds, s.max_attempts, claimed[0].claim_token
        )
    completed: list[str] = []
    if claimed:
        token = claimed[0].claim_token
        assert token is not None
        with LeaseKeeper(ctx.store, token, [c.id for c in claimed], s.lease_seconds) as keeper:
            for batch in engine_batches(claimed):
                try:
                    completed += _generate_and_record(ctx, token, batch)
                except Exception as exc:  # noqa: BLE001 - recorded on the candidates, then retried
                    if is_transient(exc):
                        raise  # the task retries; the leases lapse and the sweep takes them back
                    log.exception("generation failed for %d candidates", len(batch))
                    _release(ctx, token, batch, f"{type(exc).__name__}: {exc}")
                keeper.drop([c.id for c in batch])
    goal_ids = {c.goal_id for c in claimed} or {c.goal_id for c in ctx.store.get_candidates(candidate_ids)}
    for goal_id in sorted(goal_ids):
        ctx.dispatcher.advance_goal(goal_id)
    return completed


def engine_batches(claimed: list[CandidateView]) -> list[list[CandidateView]]:
    """How claimed candidates are run: every first attempt together, and each later attempt
    alone. A candidate whose last attempt ended early may be what ended it (an exception
    that failed its batch, or a crash that killed its worker); run again beside others it
    would take them down with it each time, until they all ran out of attempts."""
    first = [c for c in claimed if c.attempts <= 1]
    return ([first] if first else []) + [[c] for c in claimed if c.attempts > 1]


class LeaseKeeper:
    """Renews a claim's leases every third of the lease while a batch runs (a thread), so a
    long batch keeps its candidates and a dead worker's lapse within one lease."""

    def __init__(self, store: Store, token: str, ids: list[str], lease_seconds: float):
        self.store, self.token, self.ids, self.lease = store, token, ids, lease_seconds
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="agentloop-lease", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def drop(self, ids: list[str]) -> None:
        """Stop renewing these (their batch has been recorded or released)."""
        with self._lock:
            gone = set(ids)
            self.ids = [i for i in self.ids if i not in gone]

    def _run(self) -> None:
        while not self._stop.wait(self.lease / 3):
            with self._lock:
                ids = list(self.ids)
            try:
                held = self.store.renew_leases(ids, self.token, self.lease)
            except Exception:  # noqa: BLE001 - the database may be back by the next renewal
                log.warning("could not renew leases", exc_info=True)
                continue
            with self._lock:  # what was dropped meanwhile was finished, not lost
                lost = [i for i in ids if i not in held and i in self.ids]
                if lost:
                    log.warning("lost the claim on %d candidate(s)", len(lost))
                self.ids = [i for i in self.ids if i not in lost]


def transient_errors() -> tuple[type[BaseException], ...]:
    """Errors worth retrying a whole task for, with backoff: the database or the broker went
    away for a while (a restart, a failover). Anything else is a bug or a bad request."""
    from kombu.exceptions import OperationalError as BrokerError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from sqlalchemy.exc import InterfaceError, OperationalError
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    return (OperationalError, InterfaceError, PoolTimeout, BrokerError, RedisConnectionError)


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, transient_errors())


def _generate_and_record(ctx: WorkerContext, token: str, claimed: list[CandidateView]) -> list[str]:
    """Generate and score claimed candidates, which may belong to several goals and models."""
    residency = ctx.residency or Residency()
    ctx.residency = residency
    texts = ctx.store.goal_texts(sorted({c.goal_id for c in claimed}))
    done: list[str] = []
    by_model: dict[tuple[str, str], list[CandidateView]] = {}
    for c in claimed:
        by_model.setdefault((c.params["model"], c.params["scorer"]), []).append(c)
    root = ctx.settings.resolved_artifacts_dir()
    for (model, scorer), claimed_group in by_model.items():
        with residency.lock:
            runner = residency.runner(model)
            group, requests = _refuse_invalid(ctx, token, runner, claimed_group, root)
            if not group:
                continue
            score_requests = [_score_request(*texts[c.goal_id], c, ctx.settings.goal_parser)
                              for c in group]
            judge = residency.scorer(scorer)
            t0 = time.perf_counter()
            if any(r.prune_group is not None for r in requests):
                previewer = residency.scorer(preview_scorer_name(ctx.settings, scorer))
                results = runner.generate(
                    requests, preview_scorer=preview_scorer(previewer, score_requests)
                )
            else:
                results = runner.generate(requests)
            t1 = time.perf_counter()
            finished = [i for i, r in enumerate(results) if not r.pruned]
            final = judge.score([results[i].image for i in finished],
                                [score_requests[i] for i in finished])
            scores = dict(zip(finished, final, strict=True))
            t2 = time.perf_counter()
        shared = {"generate_batch_s": t1 - t0, "score_s": (t2 - t1) / max(len(finished), 1),
                  "batch_size": float(len(results))}
        outcomes, files = [], {}
        for i, (cand, result) in enumerate(zip(group, results, strict=True)):
            files[cand.id] = _save_png(root, cand, result.image)
            uri = str(files[cand.id].relative_to(root))
            timings = {**result.timings, **shared, **_prune_timings(result)}
            if result.pruned:
                outcomes.append(Outcome(cand.id, None, {}, uri, timings, CandidateStatus.PRUNED))
            else:
                outcomes.append(Outcome(cand.id, scores[i].clip_score, scores[i].part_scores,
                                        uri, timings))
        try:
            recorded = ctx.store.complete_candidates(token, outcomes)
        except BaseException:  # the database went away: nothing recorded, nothing kept
            recorded = []
            raise
        finally:  # an image whose claim was lost, or that was never recorded, is not ours
            for cid in set(files) - set(recorded):
                files[cid].unlink(missing_ok=True)
        done.extend(recorded)
    return done


def preview_scorer_name(settings: Settings, scorer: str) -> str:
    """The scorer that ranks the previews of candidates judged by ``scorer``: the one
    ``settings.preview_scorers`` names for it, when that resolves; else ``scorer`` itself."""
    from engine.catalog import is_known_scorer

    name = settings.preview_scorers.get(scorer)
    if name is None or name == scorer:
        return scorer
    if not is_known_scorer(name):
        log.warning("preview scorer %r for %r does not resolve; %r ranks its own previews",
                    name, scorer, scorer)  # fmt: skip
        return scorer
    return name


def preview_scorer(scorer: Scorer, requests: Sequence[ScoreRequest]) -> PreviewScorer:
    """The runner's preview scorer for a batch whose score requests are ``requests`` (by
    position): each preview scored as the reviser ranks finished candidates (``objective_of``:
    the CLIPScore, or for a goal of parts the mean of it and every part's)."""

    def score(positions: Sequence[int], previews: Sequence[Image.Image]) -> list[float]:
        asked = [requests[i] for i in positions]
        results = scorer.score(previews, asked)
        return [objective_of(r.clip_score, r.part_scores, q.parts)
                for r, q in zip(results, asked, strict=True)]

    return score


def _refuse_invalid(
    ctx: WorkerContext, token: str, runner: Runner, group: list[CandidateView], root: Path
) -> tuple[list[CandidateView], list[GenerationRequest]]:
    """The candidates the runner can serve, with their requests. Each one it refuses (a layout
    for a model that cannot draw one, an init image that is gone, say) fails at once with the
    reason: retrying the same request cannot help, and it must not take its batch neighbours
    down with it."""
    kept: list[CandidateView] = []
    requests: list[GenerationRequest] = []
    for c in group:
        try:
            request = _request(c, root)
            runner.validate(request)
        except ValueError as exc:
            log.warning("candidate %s refused: %s", c.id, exc)
            ctx.store.release_candidate(c.id, token, f"ValueError: {exc}", max_attempts=0)
            continue
        kept.append(c)
        requests.append(request)
    return kept, requests


def _prune_timings(result: GenerationResult) -> dict[str, float]:
    """What pruning recorded on a result, as candidate timings: the preview score, and for a
    pruned candidate the step it was cut at and its cost in generations (steps run / steps)."""
    out: dict[str, float] = {}
    if "preview_score" in result.skipped:
        out["preview_score"] = float(result.skipped["preview_score"])
    if result.pruned:
        step = float(result.skipped["pruned_at_step"])
        out |= {"pruned_at_step": step, "generation_cost": step / result.request.steps}
    return out


def _request(c: CandidateView, root: Path | None = None) -> GenerationRequest:
    """The engine request for a stored candidate, with its variation, layout and init image
    (loaded from the artifacts folder `root`) if it has them. ValueError when its init image
    cannot be read."""
    init = None
    if c.init_image is not None:
        if root is None:
            raise ValueError("an init image needs the artifacts folder")
        try:
            init = load_artifact(root, c.init_image)
        except (OSError, ValueError) as exc:
            raise ValueError(f"init image {c.init_image!r} cannot be read: {exc}") from None
    return GenerationRequest(
        prompt=c.prompt, seed=c.seed, negative_prompt=c.negative_prompt,
        width=int(c.params["width"]), height=int(c.params["height"]),
        steps=int(c.params["steps"]), guidance=float(c.params["guidance"]), model=c.params["model"],
        variation_seed=c.variation_seed,
        variation_strength=c.variation_strength,
        regions=tuple(Region(*region) for region in c.regions),
        # a group is named within its goal's iteration; one batch may hold several goals
        prune_group=None if c.prune_group is None else f"{c.goal_id}/{c.iteration}/{c.prune_group}",
        prune_keep=int(c.params.get("prune_keep", 0)),
        prune_at_step=int(c.params.get("prune_at_step", 0)),
        init_image=init,
        strength=c.strength if init is not None else 1.0,
        repair_region=c.repair_region if init is not None else None,
    )


def _score_request(
    goal: str, stored: tuple[dict, ...] | None, c: CandidateView, parser: str
) -> ScoreRequest:
    """What a candidate is judged on: the goal, and each of its parts (stored with the goal,
    else parsed from it) on the region where it should be (the candidate's layout, else the
    places the goal gives; `part_regions`)."""
    parts = parts_of(goal, stored, parser)
    regions = tuple(None if r is None else Region(*r) for r in part_regions(parts, c.regions))
    return ScoreRequest(goal, tuple(p.text for p in parts), regions)


def _save_png(root: Path, cand: CandidateView, image) -> Path:  # noqa: ANN001 - PIL image
    """Write the image atomically under a name unique to this attempt (so a worker that lost
    its claim can never overwrite the winner's image); return its path."""
    folder = root / cand.goal_id
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{cand.id}-{cand.attempts}.png"
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    image.save(tmp, format="PNG")
    os.replace(tmp, path)
    return path


def _release(ctx: WorkerContext, token: str, claimed: list[CandidateView], error: str) -> None:
    """Hand a failed batch back: each member is requeued (or failed after max_attempts) and
    sent again on its own, so a candidate that breaks its batch fails alone."""
    released = ctx.store.release_candidates(
        token, {c.id: error for c in claimed}, ctx.settings.max_attempts
    )
    for cand in claimed:
        if released.get(cand.id) is CandidateStatus.QUEUED:
            ctx.dispatcher.generate(cand.params["model"], [cand.id])
            ctx.store.mark_dispatched([cand.id])
