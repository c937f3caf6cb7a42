"""Contract conditions: CEL expressions evaluated by the ``common-expression-language`` library.

Variables available to every expression:
``envelope`` (the whole envelope as JSON), ``args`` (its arguments), ``target`` (its target
resource), ``before`` (the precondition snapshot), ``after`` (the verification read) and
``result`` (the values extracted from the tool result, when there is one).

Every expression passes the static limits of ``proofline/cel_limits.py`` before it is compiled,
is compiled once per process (a contract's expressions together, cached by the contract's digest:
:func:`compiled_for`), and every failure of the library, native panics included,
becomes a :class:`ConditionError`: a condition that cannot be evaluated has not held, and the pool
process that asked survives.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any

import cel

from proofline.cel_limits import DEFAULT_LIMITS, ConditionLimits, Shape, check
from proofline.errors import ConditionError, ConditionInputTooLarge

#: Raised through, never turned into a condition failure: the process is being stopped or timed out.
_PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)
_PASS_THROUGH_NAMES = frozenset({"SoftTimeLimitExceeded", "TimeLimitExceeded", "Terminated", "WorkerLostError"})


def _must_propagate(exc: BaseException) -> bool:
    return isinstance(exc, _PASS_THROUGH) or type(exc).__name__ in _PASS_THROUGH_NAMES


def _compile(source: str, limits: ConditionLimits = DEFAULT_LIMITS) -> tuple[Any, Shape]:
    shape = check(source, limits)
    try:
        return cel.compile(source), shape
    except BaseException as exc:  # noqa: BLE001 - a parser panic is a BaseException, not an Exception
        if _must_propagate(exc):
            raise
        raise ConditionError(f"cannot compile {source[:200]!r}: {type(exc).__name__}: {str(exc)[:300]}") from None


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: Expressions outside any contract (an envelope's own preconditions), by their text.
_compiled = lru_cache(maxsize=2048)(_compile)

#: How many contracts' compiled programs one process keeps (the least recently used go first).
CONTRACTS_KEPT = 256


class CompiledConditions:
    """Every expression of one contract, checked and compiled once, found by its text."""

    def __init__(self, digest: str, expressions: Iterable[str]) -> None:
        self.digest = digest
        self.programs = {source: _compile(source) for source in dict.fromkeys(expressions)}

    def get(self, source: str) -> tuple[Any, Shape]:
        found = self.programs.get(source)
        return found if found is not None else _compiled(source)


_by_digest: OrderedDict[str, CompiledConditions] = OrderedDict()
_by_digest_lock = threading.Lock()


def compiled_for(digest: str, expressions: Callable[[], Iterable[str]]) -> CompiledConditions:
    """The compiled expressions of the contract with this digest: compiled on first use (from
    ``expressions()``), then reused; a changed contract has another digest and is compiled anew."""
    with _by_digest_lock:
        found = _by_digest.get(digest)
        if found is not None:
            _by_digest.move_to_end(digest)
            return found
    found = CompiledConditions(digest, expressions())
    with _by_digest_lock:
        _by_digest[digest] = found
        while len(_by_digest) > CONTRACTS_KEPT:
            _by_digest.popitem(last=False)
    return found


def compile_expression(source: str, limits: ConditionLimits = DEFAULT_LIMITS) -> Any:
    """Check the static limits and compile, once per expression and process; a syntax error or a
    refused expression surfaces when the contract loads, not mid-action."""
    return _compiled(source, limits)[0]


class Variables:
    """One set of variables for several expressions, converted to CEL values (the conversion costs
    far more than running a small program: about 70 us for an envelope, 1 us for a comparison)
    into one context, each variable once, and only when an expression names it."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self._context: Any = None
        self._added: set[str] = set()

    def context(self, source: str | None = None) -> Any:
        if self._context is None:
            self._context = cel.Context()
        names = self.values.keys() if source is None else _identifiers(source).intersection(self.values)
        for name in names:
            if name not in self._added:
                self._context.add_variable(name, self.values[name])
                self._added.add(name)
        return self._context


@lru_cache(maxsize=4096)
def _identifiers(source: str) -> frozenset[str]:
    """Every identifier-like word of ``source``: a superset of the variables it can read (CEL has
    no way to name a variable other than by writing its name; words in string literals only make
    the set larger, which costs a conversion, never a wrong answer)."""
    return frozenset(_WORD.findall(source))


def _plain(variables: dict[str, Any] | Variables) -> dict[str, Any]:
    return variables.values if isinstance(variables, Variables) else variables


def _longest_list(value: Any, limit: int) -> int:
    """The longest list anywhere in ``value`` (iteratively: inputs may nest deeply), stopping early
    past ``limit``."""
    longest = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            longest = max(longest, len(item))
            if longest > limit:
                return longest
            stack.extend(item)
    return longest


def _check_inputs(source: str, shape: Shape, variables: dict[str, Any]) -> None:
    if shape.comprehensions:
        longest = _longest_list(variables, DEFAULT_LIMITS.max_list_items)
        if longest > DEFAULT_LIMITS.max_list_items:
            raise ConditionInputTooLarge(f"{source[:80]!r} iterates; an input list has {longest} items, the limit "
                                         f"is {DEFAULT_LIMITS.max_list_items}")


def evaluate_here(source: str, variables: dict[str, Any] | Variables, compiled: CompiledConditions | None = None
                  ) -> Any:
    """Evaluate in this process (limits checked, program cached, every library failure a ConditionError)."""
    program, shape = compiled.get(source) if compiled is not None else _compiled(source)
    _check_inputs(source, shape, _plain(variables))
    try:
        return program.execute(variables.context(source) if isinstance(variables, Variables) else variables)
    except BaseException as exc:  # noqa: BLE001 - PanicException derives from BaseException
        if _must_propagate(exc):
            raise
        raise ConditionError(f"cannot evaluate {source[:200]!r}: {type(exc).__name__}: {str(exc)[:300]}") from None


def evaluate(source: str, variables: dict[str, Any] | Variables, compiled: CompiledConditions | None = None) -> Any:
    """Evaluate ``source`` (from ``compiled``, the contract's programs, when given). An expression
    with a comprehension, whose cost grows with its inputs, runs in the watchdog's helper process
    under a time budget (``proofline/cel_watchdog.py``)."""
    _, shape = compiled.get(source) if compiled is not None else _compiled(source)
    if not shape.comprehensions:
        return evaluate_here(source, variables, compiled)
    _check_inputs(source, shape, _plain(variables))
    from proofline.cel_watchdog import evaluate_guarded

    return evaluate_guarded(source, _plain(variables))


def holds(source: str, variables: dict[str, Any] | Variables, compiled: CompiledConditions | None = None) -> bool:
    """True only when the expression evaluates to exactly ``true``.

    A missing field, a type error or a non-boolean value is an evaluation error: lack of evidence
    is never success, so callers decide what an error means for their stage.
    """
    value = evaluate(source, variables, compiled)
    if not isinstance(value, bool):
        raise ConditionError(f"{source[:200]!r} evaluated to {value!r:.200}, not a boolean")
    return value


def build_arguments(template: dict[str, str], variables: dict[str, Any] | Variables,
                    compiled: CompiledConditions | None = None) -> dict[str, Any]:
    """Evaluate a mapping of argument name to CEL expression (used for read-tool arguments)."""
    return {name: evaluate(expr, variables, compiled) for name, expr in template.items()}
