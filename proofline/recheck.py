"""Post-condition re-checks: when a contract asks the runtime to read a verified effect again.

A verified action is closed as ``completed_verified``; the contract's ``verification.recheck``
block may ask for more reads of the same effect afterwards, at offsets from that verdict (``at``),
all within a horizon. Each re-check reads through the verification's read path and sources with
the read identity and is judged by the same conditions; one that no longer holds is a
``postcondition_regressed`` (``recovery/recheck.py``). The schedule itself lives in Postgres
(``postcondition_checks``, written with the verdict), never in broker ETAs.

Durations are seconds (a number) or text with a unit: ``"2s"``, ``"5m"``, ``"1h"``, ``"1d"``,
``"1.5s"``, or several parts ``"1h30m"``. Small values are allowed, so that a test can wait seconds.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

#: The longest horizon a contract may ask for: a re-check row lives no longer than this.
MAX_HORIZON_SECONDS = 30 * 24 * 3600.0
#: The most re-checks one contract may schedule per verified action.
MAX_RECHECKS = 24
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(value: object) -> float:
    """Seconds of a duration: a number (seconds) or text such as ``"5m"``, ``"1h30m"``, ``"2s"``.

    Raises ValueError naming the value for anything else (no unit, an unknown unit, a sign)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration (a number of seconds or text like '5m')")
    text = value.strip().lower()
    if not text or _PART.sub("", text) != "":
        raise ValueError(f"{value!r} is not a duration: use a number with a unit (ms, s, m, h, d), e.g. '5m', '1h30m'")
    return sum(float(n) * UNITS[u] for n, u in _PART.findall(text))


#: A duration field: seconds, or text with units; the JSON Schema says both.
Duration = Annotated[float, BeforeValidator(lambda v: parse_duration(v)), WithJsonSchema({
    "anyOf": [{"type": "number"}, {"type": "string", "pattern": r"^\s*(\d+(\.\d+)?(ms|s|m|h|d))+\s*$"}],
    "description": "seconds, or a duration with units: '250ms', '2s', '5m', '1h30m', '1d'"})]


class Recheck(BaseModel):
    """``verification.recheck``: re-read the verified effect at each offset of ``at`` (after the
    verdict), all within ``horizon``; past the horizon nothing is read any more."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Offsets after the verdict, strictly ascending, each positive and within the horizon.
    at: tuple[Duration, ...] = Field(min_length=1, max_length=MAX_RECHECKS)
    #: The last moment (after the verdict) a re-check may still be read; unset: the last offset.
    horizon: Duration | None = None

    @model_validator(mode="after")
    def _ordered_within_horizon(self) -> Recheck:
        if any(offset <= 0 for offset in self.at):
            raise ValueError("recheck offsets must be positive")
        if any(later <= earlier for earlier, later in zip(self.at, self.at[1:], strict=False)):
            raise ValueError("recheck offsets must be strictly ascending")
        horizon = self.horizon_seconds
        if horizon <= 0 or horizon > MAX_HORIZON_SECONDS:
            raise ValueError(f"recheck horizon must be positive and at most {MAX_HORIZON_SECONDS:.0f} seconds")
        if self.at[-1] > horizon:
            raise ValueError(f"recheck offset {self.at[-1]:g}s is past the horizon {horizon:g}s")
        return self

    @property
    def horizon_seconds(self) -> float:
        return self.at[-1] if self.horizon is None else self.horizon
