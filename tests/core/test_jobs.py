"""The real task functions (as Celery and the embedded runtime run them) on redelivery and retry."""

from __future__ import annotations

import pytest

from agentloop.domain import CandidateStatus, GoalStatus
from agentloop.settings import Settings
from agentloop.store import Store
from engine.config import EngineConfig
from tests.core.helpers import make_goal
from workers.jobs import WorkerContext, advance_goal_job, generate_job
from workers.residency import Residency

pytestmark = pytest.mark.slow


class RecordingDispatcher:
    """Records dispatches instead of sending them, so the test decides what gets delivered
    and how often (standing in for the broker's at-least-once delivery)."""

    def __init__(self) -> None:
        self.advances: list[str] = []
        self.generations: list[list[str]] = []

    def advance_goal(self, goal_id: str) -> None:
        self.advances.append(goal_id)

    def generate(self, model: str, candidate_ids: list[str]) -> None:
        self.generations.append(list(candidate_ids))


class FailingOnce(Residency):
    """Fault injection: the first generation raises as a GPU error would; later ones run the real engine."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def runner(self, model: str):  # noqa: ANN201
        real = super().runner(model)
        if self.failed:
            return real
        self.failed = True

        class Boom:
            def validate(self, request):  # noqa: ANN001,ANN202
                real.validate(request)

            def generate(self, requests):  # noqa: ANN001,ANN202
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return Boom()


@pytest.fixture(scope="module")
def residency() -> Residency:
    return Residency()


def ctx_for(db_url: str, settings, residency: Residency) -> WorkerContext:  # noqa: ANN001
    return WorkerContext(store=Store(db_url), dispatcher=RecordingDispatcher(), settings=settings,
                         residency=residency, worker_name="w1")


def test_every_task_delivered_twice_changes_nothing(db_url: str, settings, residency: Residency) -> None:  # noqa: ANN001
    ctx = ctx_for(db_url, settings, residency)
    goal_id = make_goal(ctx.store, settings, budget=6, fanout=3, steps=2)
    for _ in range(20):
        if ctx.store.get_goal(goal_id).status.terminal:
            break
        for _ in range(2):  # the control task, delivered twice
            advance_goal_job(ctx, goal_id)
        batches, ctx.dispatcher.generations = ctx.dispatcher.generations, []
        for ids in batches:
            first = generate_job(ctx, ids)
            again = generate_job(ctx, ids)  # redelivered after it ran
            assert len(first) == len(ids) and again == []
    goal = ctx.store.get_goal(goal_id)
    cands = ctx.store.list_candidates(goal_id)
    assert goal.status is GoalStatus.DONE and goal.generations_reserved == 6 == len(cands)
    assert all(c.status is CandidateStatus.SUCCEEDED and c.attempts == 1 for c in cands)


def test_a_failed_generation_is_retried_without_spending_budget(
    db_url: str, settings, residency: Residency  # noqa: ANN001
) -> None:
    ctx = ctx_for(db_url, settings, FailingOnce())
    goal_id = make_goal(ctx.store, settings, budget=2, fanout=2, steps=2, max_iterations=1)
    advance_goal_job(ctx, goal_id)
    [ids] = ctx.dispatcher.generations
    assert generate_job(ctx, ids) == []  # the injected failure
    cands = ctx.store.list_candidates(goal_id)
    assert {c.status for c in cands} == {CandidateStatus.QUEUED}
    assert all("illegal memory access" in c.error for c in cands)
    # each member re-dispatched on its own, so a candidate that breaks a batch fails alone
    assert ctx.dispatcher.generations[-2:] == [[i] for i in ids]
    assert all(c.dispatched_at is not None for c in cands)
    assert sorted(generate_job(ctx, ids)) == sorted(ids)
    advance_goal_job(ctx, goal_id)
    goal = ctx.store.get_goal(goal_id)
    assert goal.status is GoalStatus.DONE and goal.generations_reserved == 2
    assert all(c.attempts == 2 and c.status is CandidateStatus.SUCCEEDED
               for c in ctx.store.list_candidates(goal_id))


def test_a_request_the_engine_refuses_fails_alone_and_at_once(
    db_url: str, settings, residency: Residency  # noqa: ANN001
) -> None:
    from agentloop.domain import CandidateDraft
    from agentloop.orchestrator import submit_iteration

    ctx = ctx_for(db_url, settings, residency)
    goal_id = make_goal(ctx.store, settings, reviser="external", budget=2, steps=2, model="tiny-unet")
    layout = (("a red circle", 0.25, 0.5), ("a blue square", 0.75, 0.5))
    drafts = [CandidateDraft("a red circle", 1, regions=layout), CandidateDraft("a red circle", 2)]
    decision = submit_iteration(ctx.store, goal_id, drafts)
    assert decision is not None
    refused, plain = ctx.store.list_candidates(goal_id)
    assert generate_job(ctx, decision.dispatch) == [plain.id]
    refused, plain = ctx.store.list_candidates(goal_id)
    assert plain.status is CandidateStatus.SUCCEEDED
    assert refused.status is CandidateStatus.FAILED and refused.attempts == 1
    assert "regions are supported for FluxPipeline only" in refused.error
    assert ctx.dispatcher.generations == []  # nothing re-dispatched: a retry cannot help


class Poisoned(Residency):
    """Fault injection: any batch holding the poisoned prompt raises, as a request that breaks
    the model would; batches without it run the real engine."""

    def runner(self, model: str):  # noqa: ANN201
        real = super().runner(model)

        class Guarded:
            def validate(self, request):  # noqa: ANN001,ANN202
                real.validate(request)

            def generate(self, requests):  # noqa: ANN001,ANN202
                if any("poison" in r.prompt for r in requests):
                    raise RuntimeError("NaN in the latents")
                return real.generate(requests)

        return Guarded()


def test_a_poisoned_candidate_fails_alone_and_its_batch_neighbours_succeed(
    db_url: str, settings  # noqa: ANN001
) -> None:
    from agentloop.domain import CandidateDraft
    from agentloop.orchestrator import submit_iteration

    ctx = ctx_for(db_url, settings, Poisoned())
    goal_id = make_goal(ctx.store, settings, reviser="external", budget=3, steps=2)
    drafts = [CandidateDraft("a red circle", 1), CandidateDraft("poison", 2),
              CandidateDraft("a blue square", 3)]
    ids = submit_iteration(ctx.store, goal_id, drafts).dispatch
    assert generate_job(ctx, ids) == []  # the whole batch fails once
    for _ in range(settings.max_attempts):  # then each member runs on its own
        pending, ctx.dispatcher.generations = ctx.dispatcher.generations, []
        assert all(len(batch) == 1 for batch in pending)
        for batch in pending:
            generate_job(ctx, batch)
    by_prompt = {c.prompt: c for c in ctx.store.list_candidates(goal_id)}
    assert by_prompt["poison"].status is CandidateStatus.FAILED
    assert by_prompt["poison"].attempts == settings.max_attempts
    assert "NaN in the latents" in by_prompt["poison"].error
    for prompt in ("a red circle", "a blue square"):
        assert by_prompt[prompt].status is CandidateStatus.SUCCEEDED
        assert by_prompt[prompt].attempts == 2


def test_a_poisoned_candidate_fails_alone_even_when_the_retries_come_back_together(
    db_url: str, settings  # noqa: ANN001
) -> None:
    """A worker that batches across goals takes every retry it finds in one call: a batch of
    two goals breaks on one poisoned candidate; the members, sent again one by one, are all
    delivered together, every time. Each retry still runs in an engine batch of its own, so
    only the poisoned one runs out of attempts."""
    from agentloop.domain import CandidateDraft
    from agentloop.orchestrator import submit_iteration

    residency = Poisoned()
    ctx = ctx_for(db_url, settings, residency)
    goal_a = make_goal(ctx.store, settings, reviser="external", budget=2, steps=2)
    goal_b = make_goal(ctx.store, settings, reviser="external", budget=2, steps=2)
    ids = [*submit_iteration(ctx.store, goal_a, [CandidateDraft("a red circle", 1),
                                                 CandidateDraft("poison", 2)]).dispatch,
           *submit_iteration(ctx.store, goal_b, [CandidateDraft("a blue square", 3),
                                                 CandidateDraft("a gold ring", 4)]).dispatch]
    assert generate_job(ctx, ids) == []  # the batch across both goals fails once
    for _ in range(settings.max_attempts):
        pending, ctx.dispatcher.generations = ctx.dispatcher.generations, []
        generate_job(ctx, [i for batch in pending for i in batch])  # coalesced
    assert ctx.dispatcher.generations == []
    cands = {c.prompt: c for g in (goal_a, goal_b) for c in ctx.store.list_candidates(g)}
    assert cands["poison"].status is CandidateStatus.FAILED
    assert cands["poison"].attempts == settings.max_attempts
    for prompt in ("a red circle", "a blue square", "a gold ring"):
        assert cands[prompt].status is CandidateStatus.SUCCEEDED, cands[prompt]
        assert cands[prompt].attempts == 2 and cands[prompt].timings["batch_size"] == 1.0


def test_first_attempts_of_several_goals_run_as_one_engine_batch(
    db_url: str, settings, residency: Residency  # noqa: ANN001
) -> None:
    ctx = ctx_for(db_url, settings, residency)
    goals = [make_goal(ctx.store, settings, goal=f"a red circle number {i}", budget=3, fanout=3,
                       steps=2, max_iterations=1, seed=i) for i in range(3)]
    for goal_id in goals:
        advance_goal_job(ctx, goal_id)
    ids = [i for batch in ctx.dispatcher.generations for i in batch]
    assert len(ctx.dispatcher.generations) == 3 and len(ids) == 9
    assert sorted(generate_job(ctx, ids)) == sorted(ids)
    cands = [c for g in goals for c in ctx.store.list_candidates(g)]
    assert {c.timings["batch_size"] for c in cands} == {9.0}
    assert len({c.timings["generate_batch_s"] for c in cands}) == 1  # one engine call
    assert sorted(ctx.dispatcher.advances) == sorted(goals)


class Slow(Residency):
    """Stretches each batch (sleeping before the real engine) so leases must be renewed, and
    lets the test act while the batch runs."""

    def __init__(self, seconds: float, during=None) -> None:  # noqa: ANN001
        super().__init__()
        self.seconds, self.during = seconds, during

    def runner(self, model: str):  # noqa: ANN201
        real, outer = super().runner(model), self

        class Stretched:
            def validate(self, request):  # noqa: ANN001,ANN202
                real.validate(request)

            def generate(self, requests):  # noqa: ANN001,ANN202
                import time

                if outer.during:
                    outer.during()
                time.sleep(outer.seconds)
                return real.generate(requests)

        return Stretched()


def test_a_batch_longer_than_its_lease_keeps_its_claim(db_url: str, settings) -> None:  # noqa: ANN001
    settings = settings.model_copy(update={"lease_seconds": 0.6})
    ctx = ctx_for(db_url, settings, Slow(2.0))
    goal_id = make_goal(ctx.store, settings, budget=2, fanout=2, steps=2, max_iterations=1)
    advance_goal_job(ctx, goal_id)
    [ids] = ctx.dispatcher.generations
    assert sorted(generate_job(ctx, ids)) == sorted(ids)  # renewed every 0.2 s for 2 s
    cands = ctx.store.list_candidates(goal_id)
    assert all(c.status is CandidateStatus.SUCCEEDED and c.attempts == 1 for c in cands)


def test_a_worker_that_lost_its_claim_writes_nothing(db_url: str, settings) -> None:  # noqa: ANN001
    """While the batch runs, its lease is taken over (as if this worker had been presumed
    dead): its images are deleted, and the new claim's candidates are untouched."""
    settings = settings.model_copy(update={"lease_seconds": 60})
    store = Store(db_url)
    goal_id = make_goal(store, settings, budget=2, fanout=2, steps=2, max_iterations=1)
    taken: list = []

    def take_over() -> None:
        # the lease is expired by hand and another worker claims the candidates
        ids = [c.id for c in store.list_candidates(goal_id)]
        from sqlalchemy import update

        from agentloop.store.models import CandidateRow
        from agentloop.store.store import utcnow

        with store.engine.begin() as conn:
            conn.execute(update(CandidateRow).values(lease_expires_at=utcnow().replace(year=2000)))
        taken.extend(store.claim_candidates(ids, "w2", lease_seconds=60, max_attempts=3))

    ctx = ctx_for(db_url, settings, Slow(0.0, during=take_over))
    advance_goal_job(ctx, goal_id)
    [ids] = ctx.dispatcher.generations
    assert generate_job(ctx, ids) == []
    assert len(taken) == 2
    for c in ctx.store.list_candidates(goal_id):
        assert c.status is CandidateStatus.RUNNING and c.worker == "w2" and c.attempts == 2
    folder = settings.resolved_artifacts_dir() / goal_id
    assert not folder.exists() or list(folder.iterdir()) == []


@pytest.mark.parametrize(
    ("setting", "worker", "expected"),
    [("auto", True, True), ("auto", False, None), ("on", False, True), ("off", True, False)],
)
def test_residency_compiles_in_a_worker_by_default(setting: str, worker: bool, expected) -> None:  # noqa: ANN001
    """`engine_compile` "auto": a Celery worker compiles the denoiser (long-lived, it earns
    the compile back); embedded, the engine decides (None: off on a CPU). "on"/"off" hold
    everywhere. What the EngineConfig then means on a device is tested in
    tests/engine/test_engine_gpu_path.py."""
    settings = Settings(engine_compile=setting)
    assert Residency.for_settings(settings, worker=worker).config.compile is expected


def test_engine_compile_setting_rejects_other_values() -> None:
    with pytest.raises(ValueError, match="engine_compile"):
        Settings(engine_compile="sometimes")


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_residency_takes_the_engine_dtype_setting(dtype: str) -> None:
    assert Residency.for_settings(Settings(engine_dtype=dtype)).config.dtype == dtype
    with pytest.raises(ValueError, match="engine_dtype"):
        Settings(engine_dtype="float8")


def test_residency_logs_what_the_engine_applied_when_a_model_loads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator reads in the worker's log whether its denoiser was compiled, and on what."""
    import logging

    with caplog.at_level(logging.INFO, logger="workers.residency"):
        Residency().runner("tiny-dit")
    line = next(r.getMessage() for r in caplog.records if "loaded" in r.getMessage())
    dtype = EngineConfig().resolved_dtype("cpu")  # bfloat16 on a CPU with native bfloat16
    assert line.startswith(f"model tiny-dit loaded: cpu {dtype}, attention native, compiled False")
