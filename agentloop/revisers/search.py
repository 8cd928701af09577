"""The default reviser: a score-guided local search over seeds and prompt edits."""

from __future__ import annotations

import math
import random
import re
from collections import defaultdict
from dataclasses import replace

from agentloop.domain import CandidateDraft, CandidateView, Layout
from agentloop.layout import plan_layout
from agentloop.revisers.base import Proposal, ReviserContext, derive_seed, objective

# Generic descriptive modifiers a prompt may gain or lose besides the goal's own words.
VOCABULARY: tuple[str, ...] = (
    "clear", "simple", "bold", "solid color", "sharp edges", "high contrast", "flat", "plain",
)
ARTICLES = frozenset("a an the one two some its their very".split())
PREPOSITIONS = frozenset("on in at to of with behind beside under above near below over".split())
EDIT_KINDS = ("emphasize", "reorder", "add", "strengthen", "drop")
VARIATION = "variation"
"""The kind of a candidate that keeps its parent's prompt and seed and perturbs its noise."""
LAYOUT = "layout"
"""The kind of a first-iteration candidate drawn from a layout of the goal's parts."""
SEED = "seed"
"""The kind of a candidate that is a fresh seed of a prompt (and layout) already tried."""
REPAIR = "repair"
"""The kind of a candidate that draws one failing part's region of its parent again and keeps
the rest of its parent's image ("repair:<part>")."""
REFINE = "refine"
"""The kind of a candidate drawn from its parent's image (image-to-image at a strength) with a
revised prompt; also the first candidates of a goal that starts from an image."""

Template = tuple[str, Layout]
"""What a candidate draws apart from its noise: its prompt and its layout (() for none)."""

Source = tuple[str | None, float, int | None]
"""What a candidate starts from: init image (artifact path), strength, repaired region."""
NO_SOURCE: Source = (None, 1.0, None)
"""Text-to-image: no init image."""

Identity = tuple[str, int, int | None, float, Layout, Source]
"""What makes two candidates the same image: prompt, seed, variation seed and strength,
layout, and what it starts from."""


def goal_modifiers(parts: tuple[str, ...], text: str) -> list[str]:
    """Descriptive words of the goal: in each part, the words before its noun.

    The noun is taken as the last word before the first preposition ("a small red circle
    on the left" → small, red).
    """
    words: list[str] = []
    for phrase in parts or (text,):
        tokens = re.findall(r"[a-zA-Z][a-zA-Z-]*", phrase.lower())
        cut = next((i for i, t in enumerate(tokens) if t in PREPOSITIONS), len(tokens))
        head = tokens[:cut][:-1]
        words += [t for t in head if t not in ARTICLES and t not in words]
    return words


class SearchReviser:
    """Explores fresh seeds around the best prompts and edits prompts, keeping the best so far.

    Each iteration after the first spends about half its slots on new seeds for the best
    prompts (exploitation) and half on prompt edits of the best candidates, keeping the
    parent's seed so the edit is what changes. Edit kinds that beat their parents before are
    picked more often. With a ``variation_share``, that share of the slots first goes to noise
    variations of the best candidate (same prompt and seed, slightly perturbed noise).

    A goal whose parts each name a distinct position ("a red circle on the left and a blue
    square at the top"), for a model that can draw layouts, gets a layout: the first iteration
    spends ``layout_share`` of its slots (all of them by default) on candidates that draw each
    part in its own region (see ``agentloop.layout``), the rest on the plain goal text. From
    then on the templates (prompt and layout) compete on score: the best are reseeded and
    varied, keeping their layout; prompt edits apply to plain prompts only.
    """

    name = "search"

    def __init__(
        self,
        variation_share: float = 0.0,
        variation_strength: float = 0.35,
        layout_share: float = 1.0,
        prune_factor: int = 0,
        prune_at: float = 0.2,
        repair: bool = False,
        refine: bool = False,
        repair_strength: float = 0.7,
        refine_strength: float = 0.6,
        repair_gap: float = 0.1,
        pass_score: float | None = None,
    ) -> None:
        """``variation_share``: the share of each iteration's slots (after the first) spent on
        noise variations of the best candidate; 0 proposes none. ``variation_strength``: how
        far, in (0, 1], each variation's noise moves toward its variation seed's noise.
        ``layout_share``: the share of the first iteration's slots drawn from the goal's
        layout, when it has one (rounded half up); 0 never lays a goal out. All by default:
        with the shapes model and CLIP, every plain candidate in place of a layout one made
        the CLIP-chosen image right less often (docs/layouts.md).

        ``prune_factor``: when above 1, the first iteration (the one that explores fresh
        seeds) previews ``prune_factor`` times as many candidates as it finishes: each
        template's candidates form a prune group, cut after ``prune_at`` of the steps (at
        least one step, fewer than all) to the best previews, as many as it would otherwise
        propose. The factor shrinks until the group's cost (``generation_cost``) fits the
        budget left. Off by default (docs/engine.md, "Pruning", has the measurements).
        ``repair``: redraw the one failing part of a strong layout candidate (its region, at
        ``repair_strength``) and keep the rest of its image. A part fails when its score is at
        least ``repair_gap`` below every other part's and, with a ``pass_score``, below it while
        the others reach it (CLIPScore scale). ``refine``: image-to-image of the best candidate
        at ``refine_strength`` with a revised prompt. How many slots each move gets follows
        what it has gained over its parents in this goal. Both off by default: on the shapes
        world a repair at 0.7 is right more often than a fresh layout sample and costs a
        third of its denoiser passes, but under a budget counted in images the loop with
        them chose a right image less often than without (docs/editing.md)."""
        for name, value in (("variation_share", variation_share), ("layout_share", layout_share)):
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise ValueError(f"{name} {value} is not in [0, 1]")
        for name, value in (("variation_strength", variation_strength),
                            ("repair_strength", repair_strength),
                            ("refine_strength", refine_strength)):
            if not (math.isfinite(value) and 0 < value <= 1):
                raise ValueError(f"{name} {value} is not in (0, 1]")
        if not (math.isfinite(repair_gap) and repair_gap >= 0):
            raise ValueError(f"repair_gap {repair_gap} is not a number >= 0")
        if pass_score is not None and not (math.isfinite(pass_score) and 0 < pass_score <= 2.5):
            raise ValueError(f"pass_score {pass_score} is not in (0, 2.5]")
        if isinstance(prune_factor, bool) or not isinstance(prune_factor, int) or prune_factor < 0:
            raise ValueError(f"prune_factor {prune_factor!r} is not an integer >= 0")
        if not (math.isfinite(prune_at) and 0 < prune_at < 1):
            raise ValueError(f"prune_at {prune_at} is not in (0, 1)")
        self.variation_share = variation_share
        self.variation_strength = variation_strength
        self.layout_share = layout_share
        self.repair = repair
        self.refine = refine
        self.repair_strength = repair_strength
        self.refine_strength = refine_strength
        self.repair_gap = repair_gap
        self.pass_score = pass_score
        self.prune_factor = prune_factor
        self.prune_at = prune_at

    def propose(self, ctx: ReviserContext) -> Proposal:
        rng = random.Random(derive_seed(ctx.spec.seed, ctx.iteration, 0, salt=7))
        used = {_identity_of(c) for c in ctx.history}
        ranked = ctx.scored()
        if not ranked:
            return self._first(ctx, used)
        weights = self._edit_weights(ctx)
        best = ranked[0]
        base = goal_source(ctx)
        gains = _edit_gains(ctx)
        drafts: list[CandidateDraft] = []
        plain = next((c for c in ranked if c.init_image is None), None)
        if self.variation_share > 0 and base == NO_SOURCE and plain is not None:
            n_variations = round(ctx.n * self.variation_share)
            drafts += _variations(ctx, plain, n_variations, self.variation_strength, used)
        targets = self._repair_targets(ctx, ranked)
        drafts += self._repairs(ctx, targets, ctx.n - len(drafts), gains.get(REPAIR, []), used)
        drafts += self._refines(ctx, best, ctx.n - len(drafts), gains.get(REFINE, []), used)
        rest = ctx.n - len(drafts)  # split between edits and reseeds as without other moves
        n_edits = round(rest * self._edit_share(ctx))
        parents = _unique_templates(ranked)[: max(1, min(3, rest))]
        kinds = sorted(EDIT_KINDS, key=lambda k: -weights[k] * (0.5 + rng.random()))
        if ctx.parts and weights["emphasize"] >= 1.0:
            kinds.remove("emphasize")  # a weak part is the first thing to work on
            kinds.insert(0, "emphasize")
        editable = [p for p in parents if not p.regions]  # edits rewrite one prompt
        for i in range(n_edits if editable else 0):
            parent = editable[i % len(editable)]
            draft = self._edit(ctx, parent, kinds[i % len(kinds):] + kinds[: i % len(kinds)], rng, used)
            if draft:
                drafts.append(draft)
        reseed_templates = [_template_of(p) for p in parents for _ in range(len(parents) - parents.index(p))]
        drafts += self._reseeds(ctx, reseed_templates, ctx.n - len(drafts), used, parent=best,
                                source=base)
        notes: dict[str, object] = {
            "strategy": "search",
            "best_so_far": {"id": best.id, "prompt": best.prompt, "objective": objective(best, ctx.parts)},
            "edit_weights": {k: round(v, 3) for k, v in weights.items()},
            "edits": [d.edit for d in drafts],
        }
        if targets:
            notes["repair_targets"] = [{"id": c.id, "part": part, "region": k}
                                       for c, part, k in targets]
        for kind in (REPAIR, REFINE):
            if gains.get(kind):
                notes[f"{kind}_mean_gain"] = round(sum(gains[kind]) / len(gains[kind]), 4)
        if self.variation_share > 0:
            notes["variation_share"] = self.variation_share
        return Proposal(drafts, notes)

    def _first(self, ctx: ReviserContext, used: set[Identity]) -> Proposal:
        """The first iteration: fresh seeds of the goal text, and of its layout if it has one;
        with pruning, a wider fan-out of each that is cut back to as many mid-denoise."""
        base = goal_source(ctx)
        if base != NO_SOURCE:  # the goal starts from an image: refine it with fresh seeds
            drafts = self._reseeds(ctx, [(ctx.spec.goal, ())], ctx.n, used, parent=None,
                                   edit=REFINE, source=base)
            return Proposal(drafts, {"strategy": "refine", "init_image": base[0],
                                     "strength": base[1], "reason": "the goal starts from an image"})
        plan = None
        if self.layout_share > 0 and _draws_layouts(ctx.spec.model):
            plan = plan_layout(ctx.goal_parts or ctx.parts)
        n_layout = math.floor(ctx.n * self.layout_share + 0.5) if plan else 0
        keeps = {SEED: ctx.n - n_layout, LAYOUT: n_layout}
        factor, at_step = self._prune_plan(ctx, keeps)
        drafts = self._reseeds(
            ctx, [(ctx.spec.goal, ())], keeps[SEED] * factor, used, parent=None
        )
        notes: dict[str, object] = {"strategy": "seeds", "reason": "no scored candidates yet"}
        if plan:
            drafts += self._reseeds(
                ctx, [(ctx.spec.goal, plan)], keeps[LAYOUT] * factor, used, parent=None,
                edit=LAYOUT, salt=1000,
            )
            notes["layout"] = [list(region) for region in plan]
        if factor > 1:
            drafts = [
                replace(d, prune_group=d.edit, prune_keep=keeps[d.edit or SEED],
                        prune_at_step=at_step)
                for d in drafts
            ]
            notes["pruning"] = {"factor": factor, "at_step": at_step,
                                "previewed": len(drafts), "finishing": ctx.n}
        return Proposal(drafts, notes)

    def _prune_plan(self, ctx: ReviserContext, keeps: dict[str, int]) -> tuple[int, int]:
        """(factor, step): the widest factor up to ``prune_factor`` whose groups fit the budget
        left, and the step to cut after; factor 1 where pruning is off or cannot fit."""
        steps = ctx.spec.steps
        at_step = min(steps - 1, max(1, round(self.prune_at * steps)))
        if self.prune_factor <= 1 or steps < 2:
            return 1, at_step
        left = ctx.n if ctx.budget_left is None else ctx.budget_left
        for factor in range(self.prune_factor, 1, -1):
            cost = sum(k + math.ceil((factor - 1) * k * at_step / steps - 1e-9)
                       for k in keeps.values())
            if cost <= left:
                return factor, at_step
        return 1, at_step

    def _reseeds(
        self, ctx: ReviserContext, templates: list[Template], n: int, used: set[Identity],
        parent: CandidateView | None, edit: str = "seed", salt: int = 0,
        source: Source = NO_SOURCE,
    ) -> list[CandidateDraft]:
        drafts: list[CandidateDraft] = []
        while len(drafts) < n:
            prompt, layout = templates[len(drafts) % len(templates)]
            seed = derive_seed(ctx.spec.seed, ctx.iteration, len(drafts), salt)
            salt += 1
            identity = _identity(prompt, seed, regions=layout, source=source)
            if identity in used:
                continue
            used.add(identity)
            pid = parent.id if parent and _template_of(parent) == (prompt, layout) else None
            drafts.append(CandidateDraft(
                prompt, seed, ctx.spec.negative_prompt, pid, edit, regions=layout,
                init_image=source[0], strength=source[1], repair_region=source[2],
            ))
        return drafts

    def _repair_targets(
        self, ctx: ReviserContext, ranked: list[CandidateView]
    ) -> list[tuple[CandidateView, str, int]]:
        """(candidate, failing part, its region) for the best three distinct layout images
        whose parts pass but one."""
        if not self.repair or not ctx.parts:
            return []
        targets = []
        for c in ranked[:3]:
            part = failing_part(c, ctx.parts, self.repair_gap, self.pass_score)
            k = _region_of(c, ctx.parts, part) if part else None
            if part and k is not None and c.artifact_uri:
                targets.append((c, part, k))
        return targets

    def _repairs(
        self, ctx: ReviserContext, targets: list[tuple[CandidateView, str, int]], room: int,
        gains: list[float], used: set[Identity],
    ) -> list[CandidateDraft]:
        """Repairs of the targets' failing parts, each with a fresh seed for the redrawn area:
        half the slots while repairs are untried, three quarters once they have gained over
        their parents on average, a quarter once they have not."""
        if not targets or room <= 0:
            return []
        n = min(room, max(1, round(room * _move_share(gains, 0.5, 0.75, 0.25))))
        drafts: list[CandidateDraft] = []
        for salt in range(300, 300 + 8 * n):
            if len(drafts) == n:
                break
            c, part, k = targets[len(drafts) % len(targets)]
            seed = derive_seed(ctx.spec.seed, ctx.iteration, len(drafts), salt)
            source: Source = (c.artifact_uri, self.repair_strength, k)
            identity = _identity(c.prompt, seed, regions=c.regions, source=source)
            if identity in used:
                continue
            used.add(identity)
            drafts.append(CandidateDraft(
                c.prompt, seed, c.negative_prompt, c.id, f"{REPAIR}:{part}", regions=c.regions,
                init_image=c.artifact_uri, strength=self.repair_strength, repair_region=k,
            ))
        return drafts

    def _refines(
        self, ctx: ReviserContext, best: CandidateView, room: int, gains: list[float],
        used: set[Identity],
    ) -> list[CandidateDraft]:
        """Image-to-image of the best candidate with a revised prompt (its weakest part
        first, or the goal text): one slot while refines are untried or have gained on
        average, a quarter of the slots once they have gained, none after two that have
        not. Leaves at least one slot to the search."""
        if not self.refine or room < 2 or best.artifact_uri is None:
            return []
        mean = sum(gains) / len(gains) if gains else 0.0
        if len(gains) >= 2 and mean <= 0:
            return []
        n = min(room - 1, max(1, round(room * 0.25)) if mean > 0 else 1)
        prompts = [_emphasized(ctx, best), ctx.spec.goal]
        drafts: list[CandidateDraft] = []
        source: Source = (best.artifact_uri, self.refine_strength, None)
        for salt in range(400, 400 + 8 * n):
            if len(drafts) == n:
                break
            prompt = prompts[len(drafts) % len(prompts)]
            seed = derive_seed(ctx.spec.seed, ctx.iteration, len(drafts), salt)
            identity = _identity(prompt, seed, source=source)
            if identity in used:
                continue
            used.add(identity)
            drafts.append(CandidateDraft(
                prompt, seed, best.negative_prompt, best.id, REFINE,
                init_image=best.artifact_uri, strength=self.refine_strength,
            ))
        return drafts

    def _edit_share(self, ctx: ReviserContext) -> float:
        """The share of slots spent on prompt edits, from the evidence so far.

        A quarter while no edit has been scored; half once edits beat their parents on
        average; an eighth once they have not (the rest go to fresh seeds of the best prompts).
        Noise variations are not prompt edits and do not count here.
        """
        gains = [
            g
            for kind, kind_gains in _edit_gains(ctx).items()
            if kind in EDIT_KINDS
            for g in kind_gains
        ]
        if not gains:
            return 0.25
        return 0.5 if sum(gains) / len(gains) > 0 else 0.125

    def _edit_weights(self, ctx: ReviserContext) -> dict[str, float]:
        """exp(mean gain over parent) per edit kind; unseen kinds get weight 1."""
        gains = _edit_gains(ctx)
        return {k: math.exp(10 * sum(gains[k]) / len(gains[k])) if gains[k] else 1.0
                for k in EDIT_KINDS}

    def _edit(
        self, ctx: ReviserContext, parent: CandidateView, kinds: list[str],
        rng: random.Random, used: set[Identity],
    ) -> CandidateDraft | None:
        """An unused edit of `parent`, trying edit kinds in the given order.

        The edit keeps the parent's noise (its seed, and its variation if it has one), so the
        prompt is what changes.
        """
        _, _, variation_seed, strength, _, _ = _identity_of(parent)
        source = goal_source(ctx)
        for kind in kinds:
            options = _edits_of(kind, ctx, parent)
            rng.shuffle(options)
            for edit, prompt in options:
                identity = _identity(prompt, parent.seed, variation_seed, strength, source=source)
                if identity not in used:
                    used.add(identity)
                    return CandidateDraft(
                        prompt,
                        parent.seed,
                        parent.negative_prompt,
                        parent.id,
                        edit,
                        variation_seed=variation_seed,
                        variation_strength=strength,
                        init_image=source[0],
                        strength=source[1],
                    )
        return None


def _draws_layouts(model: str) -> bool:
    """Whether the goal's model can draw a layout (the catalog knows without loading it)."""
    from engine.catalog import draws_layouts  # lazily, as the domain's model checks do

    return draws_layouts(model)


def _variations(
    ctx: ReviserContext, parent: CandidateView, n: int, strength: float, used: set[Identity]
) -> list[CandidateDraft]:
    """`n` noise variations of `parent`: its prompt, layout and seed, each with its own
    variation seed.

    A parent that is itself a variation gets siblings: the engine blends one variation seed
    into the seed's noise, so these start again from the parent's seed.
    """
    drafts: list[CandidateDraft] = []
    salt = 11
    layout = parent.regions
    while len(drafts) < n:
        variation_seed = derive_seed(ctx.spec.seed, ctx.iteration, len(drafts), salt=salt)
        salt += 1
        identity = _identity(parent.prompt, parent.seed, variation_seed, strength, layout)
        if variation_seed == parent.seed or identity in used:
            continue
        used.add(identity)
        drafts.append(
            CandidateDraft(
                parent.prompt,
                parent.seed,
                parent.negative_prompt,
                parent.id,
                f"{VARIATION}:{strength:g}",
                variation_seed=variation_seed,
                variation_strength=strength,
                regions=layout,
            )
        )
    return drafts


def _identity(
    prompt: str, seed: int, variation_seed: int | None = None, strength: float = 0.0,
    regions: Layout = (), source: Source = NO_SOURCE,
) -> Identity:
    """The image a candidate stands for; a variation of strength 0 is its plain seed."""
    if variation_seed is None or strength <= 0:
        return (prompt, seed, None, 0.0, regions, source)
    return (prompt, seed, int(variation_seed), float(strength), regions, source)


def goal_source(ctx: ReviserContext) -> Source:
    """What the goal's own candidates start from: its init image at its strength, if any."""
    spec = ctx.spec
    if spec.init_image is None:
        return NO_SOURCE
    return (spec.init_image, float(spec.init_strength or 1.0), None)


def failing_part(
    c: CandidateView, parts: tuple[str, ...], gap: float, pass_score: float | None = None
) -> str | None:
    """The one part of `c` that fails while the others pass, or None.

    A part fails when its score is at least `gap` below every other part's; with a
    `pass_score`, also when it is below that score and every other part reaches it (all on
    the CLIPScore scale). A candidate whose parts are all weak, or all close, has none: a
    fresh sample or a new layout is the better move for it.
    """
    scores = {p: c.part_scores[p] for p in parts if p in c.part_scores}
    if len(scores) < 2:
        return None
    ordered = sorted(scores, key=lambda p: scores[p])
    weakest, others = ordered[0], ordered[1:]
    if scores[others[0]] - scores[weakest] < gap:
        return None
    if pass_score is not None and not (
        scores[weakest] < pass_score <= min(scores[p] for p in others)
    ):
        return None
    return weakest


def _region_of(c: CandidateView, parts: tuple[str, ...], part: str) -> int | None:
    """The index of the region of `c`'s layout that draws `part` (None: no such region)."""
    prompts = [entry[0] for entry in c.regions]  # (prompt, x, y) or (prompt, x, y, scale)
    if part in prompts:
        return prompts.index(part)
    if len(prompts) == len(parts) and part in parts:
        return parts.index(part)
    return None


def _move_share(gains: list[float], unseen: float, paid: float, unpaid: float) -> float:
    """A move's share of the slots: `unseen` before any of it was scored, then `paid` or
    `unpaid` by whether it gained over its parents on average."""
    if not gains:
        return unseen
    return paid if sum(gains) / len(gains) > 0 else unpaid


def _emphasized(ctx: ReviserContext, c: CandidateView) -> str:
    """The goal with `c`'s weakest part first (the goal text for a one-part goal)."""
    if not ctx.parts:
        return ctx.spec.goal
    weakest = min(ctx.parts, key=lambda p: c.part_scores.get(p, 0.0))
    return " and ".join([weakest, *[p for p in ctx.parts if p != weakest]])


def _template_of(c: CandidateView) -> Template:
    return (c.prompt, c.regions)


def _identity_of(c: CandidateView) -> Identity:
    """A stored candidate's identity."""
    source: Source = NO_SOURCE
    if c.init_image is not None:
        source = (c.init_image, c.strength, c.repair_region)
    return _identity(c.prompt, c.seed, c.variation_seed, c.variation_strength, c.regions, source)


def _edit_gains(ctx: ReviserContext) -> dict[str, list[float]]:
    """Per edit kind, how much each scored edit gained over its parent (objective scale).

    The kind is the edit label's head: a prompt edit's kind from EDIT_KINDS, "variation"
    for a noise variation ("variation:0.35"), "repair" ("repair:<part>") or "refine"; fresh
    seeds ("seed") are not edits.
    """
    by_id = {c.id: c for c in ctx.history}
    gains: dict[str, list[float]] = defaultdict(list)
    for c in ctx.history:
        parent = by_id.get(c.parent_id or "")
        if c.edit and c.edit != "seed" and parent and c.clip_score is not None and parent.clip_score is not None:
            gains[c.edit.split(":", 1)[0]].append(objective(c, ctx.parts) - objective(parent, ctx.parts))
    return gains


def _unique_templates(ranked: list[CandidateView]) -> list[CandidateView]:
    """The best candidate of each template (prompt and layout), best first."""
    seen: set[Template] = set()
    out = []
    for c in ranked:
        if _template_of(c) not in seen:
            seen.add(_template_of(c))
            out.append(c)
    return out


def _edits_of(kind: str, ctx: ReviserContext, parent: CandidateView) -> list[tuple[str, str]]:
    """(edit label, new prompt) pairs of one kind for a parent candidate."""
    prompt = parent.prompt
    if kind == "emphasize" and ctx.parts:
        weakest = min(ctx.parts, key=lambda p: parent.part_scores.get(p, 0.0))
        rest = [p for p in ctx.parts if p != weakest]
        return [(f"emphasize:{weakest}", " and ".join([weakest, *rest]))]
    if kind == "reorder":
        moved = _front_prepositional(prompt)
        return [("reorder", moved)] if moved and moved != prompt else []
    if kind == "add":
        words = [w for w in (*goal_modifiers(ctx.parts, ctx.spec.goal), *VOCABULARY)
                 if f", {w}" not in prompt]
        return [(f"add:{w}", f"{prompt}, {w}") for w in words]
    if kind == "strengthen":
        out = []
        for w in goal_modifiers(ctx.parts, ctx.spec.goal):
            if re.search(rf"\b{re.escape(w)}\b", prompt) and f"very {w}" not in prompt:
                out.append((f"strengthen:{w}", re.sub(rf"\b{re.escape(w)}\b", f"very {w}", prompt, count=1)))
        return out
    if kind == "drop":
        added = re.findall(r", ([^,]+)", prompt)
        out = [(f"drop:{w}", prompt.replace(f", {w}", "", 1)) for w in added]
        out += [(f"drop:very {w}", prompt.replace(f"very {w}", w, 1))
                for w in re.findall(r"very (\w+)", prompt)]
        return out
    return []


def _front_prepositional(prompt: str) -> str | None:
    """Move each part's trailing prepositional phrase to its front.

    "a small red circle on the left" → "on the left, a small red circle". Same meaning, other
    word order: a cheap way to shake a text encoder's reading of the prompt.
    """
    out = []
    for part in re.split(r"\s+and\s+", prompt):
        words = part.split()
        cut = next((i for i, w in enumerate(words) if w.lower() in PREPOSITIONS and i > 0), None)
        if cut is None:
            out.append(part)
            continue
        out.append(f"{' '.join(words[cut:])}, {' '.join(words[:cut])}".replace(",,", ","))
    moved = " and ".join(out)
    return moved if moved != prompt else None
