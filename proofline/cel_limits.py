"""Static limits on CEL expressions, checked before the CEL library ever sees the text.

The library (a Rust parser and tree-walking evaluator) recurses on the expression's tree: a deep
or very long expression overflows the native stack and kills the whole process (a segmentation
fault, or a ``PanicException`` that ``except Exception`` does not catch), and nested
comprehensions multiply their iteration counts. So every expression is scanned first, in one
pass with no recursion, and refused unless it is small and shallow:

- ``max_chars``: its length;
- ``max_depth``: nesting of parentheses, brackets and braces;
- ``max_operators``: operators, member selections, index and call sites (each one a tree node
  above its operands, so this bounds the tree's depth even without parentheses: ``1 + 1 + …``);
- ``max_operands``: identifiers and literals;
- ``max_comprehensions`` and ``max_comprehension_depth``: the macros ``all``, ``exists``,
  ``exists_one``, ``map`` and ``filter``; nesting one inside another is refused by default, so the
  cost of an expression is linear in the size of the lists it iterates over, and those lists are
  bounded at evaluation (``max_list_items``, see ``proofline/conditions.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from proofline.errors import ConditionTooComplex

COMPREHENSIONS = frozenset({"all", "exists", "exists_one", "map", "filter"})
#: Two-character operators first, so ``<=`` is one operator and not ``<`` then ``=``.
_OPERATORS_2 = ("&&", "||", "==", "!=", "<=", ">=")
_OPERATORS_1 = frozenset("+-*/%!<>?:.")
_OPEN, _CLOSE = "([{", ")]}"


@dataclass(frozen=True)
class ConditionLimits:
    max_chars: int = 1000
    max_depth: int = 12
    max_operators: int = 64
    max_operands: int = 64
    max_comprehensions: int = 2
    max_comprehension_depth: int = 1
    #: Longest list a comprehension may iterate over (checked on the variables at evaluation).
    max_list_items: int = 1000


DEFAULT_LIMITS = ConditionLimits()


@dataclass(frozen=True)
class Shape:
    """What the scanner measured."""

    chars: int
    depth: int
    operators: int
    operands: int
    comprehensions: int
    comprehension_depth: int


def _skip_string(source: str, i: int, raw: bool) -> int:
    """Index just past the string literal starting at ``source[i]`` (a quote)."""
    quote = source[i]
    triple = source.startswith(quote * 3, i)
    end_mark = quote * 3 if triple else quote
    j = i + len(end_mark)
    n = len(source)
    while j < n:
        if not raw and source[j] == "\\":
            j += 2
            continue
        if source.startswith(end_mark, j):
            return j + len(end_mark)
        j += 1
    return n  # unterminated: the compiler reports it, the scan just stops


def measure(source: str) -> Shape:
    """One linear pass over the text; no recursion, so any input is safe to measure."""
    n = len(source)
    i = depth = max_depth = operators = operands = 0
    comprehensions = max_comp = 0
    comp_stack: list[int] = []  # bracket depth at which each open comprehension's "(" sits
    pending_comp = False  # a comprehension name was just read; its "(" comes next
    prev = ""  # the previous significant character
    while i < n:
        c = source[i]
        if c.isspace():
            i += 1
            continue
        if c in "'\"" or (c in "rRbB" and i + 1 < n and (source[i + 1] in "'\"" or (
                source[i + 1] in "rRbB" and i + 2 < n and source[i + 2] in "'\""))):
            raw = False
            while source[i] in "rRbB":
                raw = raw or source[i] in "rR"
                i += 1
            i = _skip_string(source, i, raw)
            operands += 1
            prev = "'"
            continue
        if c.isalpha() or c == "_":
            j = i + 1
            while j < n and (source[j].isalnum() or source[j] == "_"):
                j += 1
            word = source[i:j]
            k = j
            while k < n and source[k].isspace():
                k += 1
            called = k < n and source[k] == "("
            if word == "in":
                operators += 1
            elif called:
                operators += 1  # a call site
                pending_comp = prev == "." and word in COMPREHENSIONS
            else:
                operands += 1
            prev = "a"
            i = j
            continue
        if c.isdigit():
            j = i + 1
            while j < n and (source[j].isalnum() or source[j] in "._"):
                j += 1
            operands += 1
            prev = "0"
            i = j
            continue
        if c in _OPEN:
            if c == "[" and prev in ("a", "0", "'", ")", "]", "}"):
                operators += 1  # an index
            depth += 1
            max_depth = max(max_depth, depth)
            if c == "(" and pending_comp:
                comprehensions += 1
                comp_stack.append(depth)
                max_comp = max(max_comp, len(comp_stack))
            pending_comp = False
            prev = c
            i += 1
            continue
        if c in _CLOSE:
            if comp_stack and comp_stack[-1] == depth and c == ")":
                comp_stack.pop()
            depth = max(0, depth - 1)
            prev = c
            i += 1
            continue
        if source.startswith(_OPERATORS_2, i):
            operators += 1
            prev = c
            i += 2
            continue
        if c in _OPERATORS_1:
            operators += 1
        prev = c
        i += 1
    return Shape(n, max_depth, operators, operands, comprehensions, max_comp)


def check(source: str, limits: ConditionLimits = DEFAULT_LIMITS) -> Shape:
    """Raise :class:`ConditionTooComplex` unless ``source`` is within every limit."""
    if not isinstance(source, str):
        raise ConditionTooComplex(f"a condition is a string, not {type(source).__name__}")
    if len(source) > limits.max_chars:
        # Refused before scanning: nothing of a large text is looked at twice.
        raise ConditionTooComplex(f"condition is {len(source)} characters; the limit is {limits.max_chars}",
                                  limit="max_chars", value=len(source))
    shape = measure(source)
    for name, value, limit in (
        ("max_depth", shape.depth, limits.max_depth),
        ("max_operators", shape.operators, limits.max_operators),
        ("max_operands", shape.operands, limits.max_operands),
        ("max_comprehensions", shape.comprehensions, limits.max_comprehensions),
        ("max_comprehension_depth", shape.comprehension_depth, limits.max_comprehension_depth),
    ):
        if value > limit:
            raise ConditionTooComplex(f"condition {source[:80]!r}: {name.removeprefix('max_')} is {value}; "
                                      f"the limit is {limit}", limit=name, value=value)
    return shape
