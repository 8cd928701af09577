"""Stand-ins for the broker and the GPU workers, so the HTTP layer is tested on its own.

No diffusion model is loaded here: `finish` claims and completes candidates through the
store exactly as a worker would, with scores the test chooses and a small PNG on disk.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from sqlalchemy import func, select

from agentloop.dispatch import InProcessDispatcher
from agentloop.domain import CandidateView
from agentloop.orchestrator import advance
from agentloop.settings import Settings
from agentloop.store import Store
from agentloop.store.models import CandidateRow, GoalRow, IterationRow

WORKER = "fake-worker"


@dataclass
class RecordingDispatcher:
    """Stands in for the Celery broker: records what the API dispatches and runs nothing."""

    advanced: list[str] = field(default_factory=list)
    generated: list[tuple[str, list[str]]] = field(default_factory=list)

    def advance_goal(self, goal_id: str) -> None:
        self.advanced.append(goal_id)

    def generate(self, model: str, candidate_ids: list[str]) -> None:
        self.generated.append((model, list(candidate_ids)))


def png_bytes(color: str = "red") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def finish(
    store: Store, settings: Settings, ids: Sequence[str],
    score: Callable[[CandidateView], float] = lambda c: 1.0,
) -> None:
    """Do a generation worker's part for `ids`: claim, write a PNG, complete with `score`."""
    root = settings.resolved_artifacts_dir()
    for c in store.claim_candidates(ids, WORKER, lease_seconds=900, max_attempts=3):
        (root / c.goal_id).mkdir(parents=True, exist_ok=True)
        (root / c.goal_id / f"{c.id}.png").write_bytes(png_bytes())
        store.complete_candidate(
            c.id, c.claim_token, clip_score=score(c), part_scores={},
            artifact_uri=f"{c.goal_id}/{c.id}.png", timings={"denoise_s": 0.001},
        )


def threaded_loop(
    store: Store, settings: Settings, score: Callable[[CandidateView], float] = lambda c: 1.0
) -> InProcessDispatcher:
    """The in-process dispatcher running the orchestrator for real and `finish` as the worker."""
    dispatcher = InProcessDispatcher()

    def advance_goal(goal_id: str) -> None:
        decision = advance(store, goal_id)
        if decision is not None and decision.dispatch and decision.model:
            dispatcher.generate(decision.model, decision.dispatch)

    def generate(ids: list[str]) -> None:
        finish(store, settings, ids, score)
        for goal_id in {c.goal_id for c in store.get_candidates(ids)}:
            dispatcher.advance_goal(goal_id)

    dispatcher.bind(advance_goal, generate)
    return dispatcher


def row_counts(store: Store) -> dict[str, int]:
    """Rows per table, counted in SQL."""
    with store.engine.connect() as conn:
        return {
            row.__tablename__: int(conn.scalar(select(func.count()).select_from(row)) or 0)
            for row in (GoalRow, IterationRow, CandidateRow)
        }


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []
