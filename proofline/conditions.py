"""Contract conditions: CEL expressions evaluated by the ``common-expression-language`` library.

Variables available to every expression:
``envelope`` (the whole envelope as JSON), ``args`` (its arguments), ``target`` (its target
resource), ``before`` (the precondition snapshot), ``after`` (the verification read) and
``result`` (the values extracted from the tool result, when there is one).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import cel

from proofline.errors import ConditionError


@lru_cache(maxsize=1024)
def compile_expression(source: str) -> Any:
    """Compile once; a syntax error surfaces when the contract loads, not mid-action."""
    try:
        return cel.compile(source)
    except ValueError as exc:
        raise ConditionError(f"cannot compile {source!r}: {exc}") from exc


def evaluate(source: str, variables: dict[str, Any]) -> Any:
    program = compile_expression(source)
    try:
        return program.execute(variables)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise ConditionError(f"cannot evaluate {source!r}: {exc!r}") from exc


def holds(source: str, variables: dict[str, Any]) -> bool:
    """True only when the expression evaluates to exactly ``true``.

    A missing field, a type error or a non-boolean value is an evaluation error: lack of evidence
    is never success, so callers decide what an error means for their stage.
    """
    value = evaluate(source, variables)
    if not isinstance(value, bool):
        raise ConditionError(f"{source!r} evaluated to {value!r}, not a boolean")
    return value


def build_arguments(template: dict[str, str], variables: dict[str, Any]) -> dict[str, Any]:
    """Evaluate a mapping of argument name to CEL expression (used for read-tool arguments)."""
    return {name: evaluate(expr, variables) for name, expr in template.items()}
