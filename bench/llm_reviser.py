"""What the `llm` reviser adds around the model's own time, per iteration.

    python bench/llm_reviser.py --iterations 200 --n 8

No language model runs here, so a scripted chat-completions server (tests/core/llm_server.py,
a real HTTP server on a free port, in a subprocess of its own) answers every request at once
with a fixed valid answer of `n` moves. Measured, on the same hand-made history of 24 scored
candidates, as the median per call of this process's CPU time (the server's is not counted;
robust on a loaded machine) and of wall time (loopback HTTP included):

- `search propose`: the `search` reviser's proposal (the baseline: no I/O);
- `llm propose`: the `llm` reviser's proposal: building the situation, the HTTP round trip
  over loopback, reading and validating the answer, turning moves into drafts;
- `llm fallback`: a proposal whose endpoint answers 500 once (one attempt, then `search`);
- `advance search` / `advance llm`: one orchestrator step that proposes an iteration, on
  SQLite, including its transaction (the llm step rolls back, asks outside the lock, and
  steps again).

A real model adds its own latency (seconds) on top; this is the part agentloop owns. The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentloop.domain import CandidateStatus, CandidateView, GoalRequest, check_goal, split_parts  # noqa: E402
from agentloop.llm import LlmConfig  # noqa: E402
from agentloop.revisers import LlmReviser, ReviserContext, SearchReviser  # noqa: E402
from agentloop.settings import Settings  # noqa: E402

GOAL = "a red circle on the left and a blue square on the right"


def history(k: int) -> list[CandidateView]:
    parts = split_parts(GOAL)
    return [CandidateView(
        id=f"c{i:03d}", goal_id="g", iteration=i // 4, ordinal=i % 4, prompt=f"{GOAL}, take {i}",
        negative_prompt="", seed=1000 + i, params={}, status=CandidateStatus.SUCCEEDED,
        attempts=1, worker="w", clip_score=0.5 + (i % 7) / 20,
        part_scores={parts[0]: 0.4 + (i % 5) / 20, parts[1]: 0.3 + (i % 3) / 20},
        artifact_uri=None, timings={}, error=None, parent_id=None, edit=None, queued_at=None,
        started_at=None, finished_at=None) for i in range(k)]


def answer(n: int, parent: str) -> dict[str, Any]:
    moves: list[dict[str, Any]] = []
    for i in range(n):
        if i % 2:
            moves.append({"kind": "refine", "parent_id": parent, "prompt": f"{GOAL}, bold {i}",
                          "why": "sharpen the best"})
        else:
            moves.append({"kind": "prompt", "prompt": f"{GOAL}, version {i}", "seed": "new"})
    return {"rationale": "bench", "moves": moves}


Timing = tuple[float, float]
"""(median CPU ms, median wall ms) per call."""


def median_ms(fn: Callable[[], Any], iterations: int) -> Timing:
    fn()  # warm-up
    cpu, wall = [], []
    for _ in range(iterations):
        c, w = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu) * 1000, statistics.median(wall) * 1000


@contextmanager
def scripted_server(reply: dict[str, Any] | None) -> Iterator[str]:
    """The scripted server in a subprocess answering `reply` (a chat completion's content)
    to every request, or HTTP 500 when None; yields its base URL."""
    code = (
        "import json, sys\n"
        "from tests.core.llm_server import Reply, ScriptedLLM, chat\n"
        "content = json.loads(sys.argv[1])\n"
        "reply = chat(content) if content is not None else "
        "Reply(500, {'error': {'message': 'down'}})\n"
        "ScriptedLLM(lambda body: reply).serve_forever()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(reply)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def advance_ms(settings: Settings, reviser: str, iterations: int) -> Timing:
    """Median cost of one orchestrator step that proposes a goal's first iteration."""
    from agentloop.migrate import upgrade
    from agentloop.orchestrator import Policy, advance
    from agentloop.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        upgrade(url)
        store = Store(url)
        policy = Policy.of(settings)
        spec = check_goal(GoalRequest(goal=GOAL, budget=64, fanout=8, reviser=reviser), settings)
        goals = iter([store.create_goal(spec).id for _ in range(iterations + 1)])

        def one() -> None:
            decision = advance(store, next(goals), policy)
            assert decision is not None and len(decision.new_candidates) == 8

        timing = median_ms(one, iterations)
        store.dispose()
    return timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--n", type=int, default=8, help="candidates per iteration")
    args = ap.parse_args()
    hist = history(24)
    base = Settings(default_model="tiny-dit", default_scorer="tiny-clip")
    spec = check_goal(GoalRequest(goal=GOAL), base)
    ctx = ReviserContext(spec, split_parts(GOAL), 6, args.n, hist)
    rows: dict[str, Timing] = {}
    rows["search propose"] = median_ms(lambda: SearchReviser().propose(ctx), args.iterations)
    with scripted_server(answer(args.n, ctx.scored()[0].id)) as url:
        reviser = LlmReviser(LlmConfig(url, "scripted"))
        p = reviser.propose(ctx)
        assert p.notes["strategy"] == "llm" and len(p.candidates) == args.n, p.notes
        rows["llm propose"] = median_ms(lambda: reviser.propose(ctx), args.iterations)
    with scripted_server(None) as url:
        reviser = LlmReviser(LlmConfig(url, "scripted", max_attempts=1))
        assert reviser.propose(ctx).notes["llm"]["fallback"].startswith("HTTP 500")
        rows["llm fallback"] = median_ms(lambda: reviser.propose(ctx), args.iterations)
    steps = max(20, args.iterations // 4)
    rows["advance search"] = advance_ms(base, "search", steps)
    first = {"moves": [{"kind": "prompt", "prompt": f"{GOAL}, v{i}", "seed": "new"}
                       for i in range(args.n)]}  # a first iteration: no parents yet
    with scripted_server(first) as url:
        configured = base.model_copy(update={"llm_base_url": url, "llm_model": "scripted"})
        rows["advance llm"] = advance_ms(configured, "llm", steps)
    print(f"{'what':<16} {'CPU ms':>8} {'wall ms':>8}")
    for name, (cpu, wall) in rows.items():
        print(f"{name:<16} {cpu:>8.2f} {wall:>8.2f}")
    print(f"per iteration, the llm reviser costs {rows['llm propose'][0]:.2f} ms CPU here (search "
          f"{rows['search propose'][0]:.2f}); an orchestrator step "
          f"{rows['advance llm'][0] - rows['advance search'][0]:+.2f} ms CPU against search's")
    figures: dict[str, Any] = {"bench": "llm_reviser", "n": args.n,
                               "iterations": args.iterations, "history": len(hist)}
    for name, (cpu, wall) in rows.items():
        key = name.replace(" ", "_")
        figures[f"{key}_cpu_ms"] = round(cpu, 3)
        figures[f"{key}_wall_ms"] = round(wall, 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
