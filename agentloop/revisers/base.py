"""The reviser plug-in interface: read the scored history, propose the next candidates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from agentloop.domain import CandidateDraft, CandidateStatus, CandidateView, GoalSpec
from agentloop.parts import Part


@dataclass
class ReviserContext:
    """What a reviser sees: the goal, its parts, the whole history, and how many to propose.

    ``parts`` are the part texts (the keys of each candidate's ``part_scores``);
    ``goal_parts`` the same parts parsed (subject, place, scale; `agentloop.parts`), in the
    same order, which is also the order of the regions of the goal's planned layout."""

    spec: GoalSpec
    parts: tuple[str, ...]
    iteration: int
    n: int
    """How many candidates the iteration should finish (the fan-out, or the budget left)."""
    history: list[CandidateView]
    budget_left: int | None = None
    """Generations of budget left to reserve (None: n). A proposal with prune groups may hold
    more than ``n`` candidates when only ``n`` finish and ``generation_cost`` fits here."""
    goal_parts: tuple[Part, ...] = ()

    def scored(self) -> list[CandidateView]:
        """Succeeded candidates, best first."""
        done = [c for c in self.history if c.status is CandidateStatus.SUCCEEDED]
        return sorted(done, key=lambda c: (-objective(c, self.parts), c.iteration, c.ordinal))


@dataclass
class Proposal:
    """The next iteration's candidates and the reviser's notes on why."""

    candidates: list[CandidateDraft]
    notes: dict[str, Any] = field(default_factory=dict)


class Reviser(Protocol):
    """Proposes candidates; must be deterministic given its context."""

    name: str

    def propose(self, ctx: ReviserContext) -> Proposal: ...


def objective(c: CandidateView, parts: tuple[str, ...]) -> float:
    """How candidates are ranked, on the CLIPScore scale (2.5·max(cos, 0), Hessel et al. 2021).

    A one-part goal ranks by its CLIPScore. A goal of several parts ranks by the mean of the
    whole-goal CLIPScore and every part's CLIPScore (each judged on its own region where the
    candidate has one): the whole goal counts as one part more. An image that drops a part
    loses that part's score; the whole-goal score, which judges how attributes bind to objects
    poorly and the worse the more objects a goal has, weighs 1/(k+1) with k parts, yet still
    judges what no part holds (a background, a style). Measured against the mean of the whole
    and the weakest part, the objective before: docs/benchmarks.md, "Every part counts"."""
    return objective_of(c.clip_score, c.part_scores, parts)


def objective_of(
    clip_score: float | None, part_scores: dict[str, float], parts: tuple[str, ...]
) -> float:
    """``objective`` of a score and its part scores (e.g. a preview's, before any candidate
    holds them)."""
    score = clip_score or 0.0
    part_values = [part_scores[p] for p in parts if p in part_scores]
    return (score + sum(part_values)) / (len(part_values) + 1)


def derive_seed(base: int, iteration: int, ordinal: int, salt: int = 0) -> int:
    """A fresh, deterministic 31-bit seed for (goal seed, iteration, ordinal)."""
    x = ((base + 1) * 0x9E3779B97F4A7C15 + iteration * 0xBF58476D1CE4E5B9 + ordinal * 0x94D049BB133111EB
         + salt * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 32
    return int(x & 0x7FFFFFFF)
