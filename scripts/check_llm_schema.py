"""Check that the `llm` reviser's answer schema compiles for vLLM's structured output.

    pip install xgrammar && python scripts/check_llm_schema.py

vLLM turns a `response_format` JSON schema into a grammar with xgrammar (its default
structured-output backend) and refuses a schema xgrammar cannot compile. This compiles
`ANSWER_SCHEMA` in strict mode and checks that the grammar accepts one answer of each move
kind and refuses answers that break it, so a change to the schema is checked before a server
sees it. xgrammar is not one of agentloop's dependencies: run this by hand after changing
the schema (docs/revisers.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentloop.revisers.llm import ANSWER_SCHEMA, Answer  # noqa: E402

EMPTY: dict[str, Any] = {
    "kind": "prompt", "parent_id": None, "prompt": None, "negative_prompt": None, "seed": None,
    "regions": None, "variation_strength": None, "area": None, "strength": None, "why": None,
}


def move(**fields: Any) -> dict[str, Any]:
    return EMPTY | fields


ACCEPTED = {
    "prompt": move(prompt="a red circle", seed="new", why="fresh"),
    "layout": move(kind="layout", regions=[{"prompt": "a red circle", "x": 0.25, "y": 0.5}], seed=7),
    "refine": move(kind="refine", parent_id="c0", prompt="a red circle, bold", seed="parent",
                   variation_strength=0.2),
    "repair": move(kind="repair", parent_id="c0", prompt="a blue square", strength=0.5,
                   area={"x": 0.5, "y": 0.25, "w": 0.5, "h": 0.5}),
}
REFUSED = {
    "an unknown kind": move(kind="paint", prompt="a"),
    "an anchor of 1.5": move(kind="layout", regions=[{"prompt": "a", "x": 1.5, "y": 0.5}]),
    "a seed that is a string of digits": move(prompt="a", seed="7"),
    "an unknown field": move(prompt="a") | {"colour": "red"},
}


def main() -> int:
    try:
        import xgrammar
        from xgrammar.testing import _is_grammar_accept_string
    except ImportError:
        print("xgrammar is not installed: pip install xgrammar", file=sys.stderr)
        return 2
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(ANSWER_SCHEMA), strict_mode=True)
    failures = []
    for name, m in ACCEPTED.items():
        answer = {"rationale": None, "moves": [m]}
        ok = _is_grammar_accept_string(grammar, json.dumps(answer))
        Answer.model_validate(answer, context={"ids": {"c0"}})  # and the parser takes it
        print(f"{'accepted' if ok else 'REFUSED':<9} a {name} move")
        failures += [] if ok else [name]
    for name, m in REFUSED.items():
        ok = not _is_grammar_accept_string(grammar, json.dumps({"rationale": None, "moves": [m]}))
        print(f"{'refused' if ok else 'ACCEPTED':<9} {name}")
        failures += [] if ok else [name]
    from importlib.metadata import version

    print(json.dumps({"xgrammar": version("xgrammar"), "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
