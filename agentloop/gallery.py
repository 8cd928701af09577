"""The output folder of a finished goal: each candidate's PNG, summary.json, index.html."""

from __future__ import annotations

import html
import json
import shutil
from pathlib import Path
from typing import Any

from agentloop.api.schemas import SCORE_SCALE
from agentloop.domain import CandidateStatus, GoalState


def summary(state: GoalState, out: Path | None = None) -> dict[str, Any]:
    """The goal's result as plain JSON: what `--json` prints and summary.json holds."""
    goal = state.goal
    best = next((c for c in state.candidates if c.id == goal.best_candidate_id), None)
    per_iteration = [it.best_score for it in state.iterations]
    return {
        "goal_id": goal.id,
        "goal": goal.text,
        "status": goal.status.value,
        "stop_reason": goal.stop_reason,
        "error": goal.error,
        "generations_used": goal.generations_reserved,
        "budget": goal.budget,
        "best_score": goal.best_score,
        "score_scale": SCORE_SCALE,
        "best_prompt": best.prompt if best else None,
        "best_part_scores": dict(best.part_scores) if best else None,
        "best_seed": best.seed if best else None,
        "best_image": str(out / _image_name(best.iteration, best.ordinal)) if best and out else None,
        "iteration_best_scores": per_iteration,
        "spec": goal.spec.to_json(),
    }


def _image_name(iteration: int, ordinal: int) -> str:
    return f"iter{iteration:02d}-cand{ordinal:02d}.png"


def write_output(state: GoalState, artifacts_dir: Path, out: Path) -> dict[str, Any]:
    """Copy the images, write summary.json and a static index.html gallery; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in state.candidates:
        image = None
        if c.status is CandidateStatus.SUCCEEDED and c.artifact_uri:
            image = _image_name(c.iteration, c.ordinal)
            shutil.copyfile(artifacts_dir / c.artifact_uri, out / image)
        rows.append({
            "id": c.id, "iteration": c.iteration, "ordinal": c.ordinal, "status": c.status.value,
            "prompt": c.prompt, "seed": c.seed, "edit": c.edit, "clip_score": c.clip_score,
            "part_scores": c.part_scores, "image": image, "worker": c.worker,
            "attempts": c.attempts, "timings": c.timings, "error": c.error,
            "regions": [list(r) for r in c.regions],
        })
    data = summary(state, out)
    data["candidates"] = rows
    (out / "summary.json").write_text(json.dumps(data, indent=2))
    (out / "index.html").write_text(_html(data))
    return data


def _label(row: dict[str, Any]) -> str:
    """A candidate's edit, marked "layout" when it was drawn from one."""
    label = row["edit"] or ""
    if row.get("regions") and label != "layout":
        label = f"{label} · layout" if label else "layout"
    return label


def _part_lines(row: dict[str, Any]) -> str:
    """Each part's score (judged on its region where the candidate has one), one line each."""
    parts = row.get("part_scores") or {}
    return "".join(f"<br><small>{html.escape(p)}: {v:.3f}</small>" for p, v in parts.items())


def _html(data: dict[str, Any]) -> str:
    esc = html.escape
    best_id = next((r["id"] for r in data["candidates"] if r["prompt"] == data["best_prompt"]
                    and r["seed"] == data["best_seed"]), None)
    cells: dict[int, list[str]] = {}
    for r in data["candidates"]:
        score = f'{r["clip_score"]:.3f}' if r["clip_score"] is not None else r["status"]
        img = f'<img src="{esc(r["image"])}" alt="{esc(r["prompt"])}">' if r["image"] else "<div class=missing>no image</div>"
        cls = "cand best" if r["id"] == best_id else "cand"
        cells.setdefault(r["iteration"], []).append(
            f'<figure class="{cls}">{img}<figcaption><b>{score}</b> · seed {r["seed"]}'
            f'<br>{esc(r["prompt"])}<br><i>{esc(_label(r))}</i>{_part_lines(r)}</figcaption></figure>'
        )
    sections = "".join(
        f"<h2>Iteration {i}</h2><div class=grid>{''.join(cs)}</div>" for i, cs in sorted(cells.items())
    )
    best = f'{data["best_score"]:.3f}' if data["best_score"] is not None else "–"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>agentloop · {esc(data["goal"])}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2rem;background:#fafafa;color:#222}}
.grid{{display:flex;flex-wrap:wrap;gap:12px}}
figure{{margin:0;width:160px;background:#fff;border:2px solid #ddd;border-radius:6px;padding:6px}}
figure.best{{border-color:#2a9d4b}}
img{{width:148px;height:148px;image-rendering:pixelated;display:block}}
figcaption{{font-size:12px;margin-top:4px;word-break:break-word}}
</style></head><body>
<h1>{esc(data["goal"])}</h1>
<p>Status <b>{esc(data["status"])}</b> ({esc(str(data["stop_reason"]))}) ·
{data["generations_used"]} of {data["budget"]} generations · best score <b>{best}</b>
({esc(data["score_scale"])})</p>
<p>Best prompt: <code>{esc(str(data["best_prompt"]))}</code></p>
{sections}
</body></html>
"""
