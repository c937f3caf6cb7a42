"""One exit code per class of error, so scripts can branch without parsing text.

Each row is (exit code, what it means, the error classes or stable codes it covers). The first
row whose class matches (``isinstance``, most specific first) decides. The command line reference
(docs/reference/cli.md) prints this table; ``tests/integration/test_cli_errors.py`` checks that the two agree.
"""

from __future__ import annotations

import click
import psycopg
from pydantic import ValidationError

from proofline import errors as e

OK = 0
#: A check ran and found a problem (verify-ledger, contracts check): an answer, not an error.
CHECK_FAILED = 1
USAGE = 2
INTERNAL = 70
INTERRUPTED = 130

#: (exit code, name, classes): matched in order.
TABLE: tuple[tuple[int, str, tuple[type[BaseException], ...]], ...] = (
    (USAGE, "usage", (click.UsageError,)),
    (4, "database_unavailable", (e.DatabaseUnavailable, psycopg.OperationalError)),
    (3, "configuration_error", (e.ConfigurationError,)),
    (5, "broker_unavailable", (e.BrokerUnavailable,)),
    (6, "not_found", (e.NotFound,)),
    (7, "unknown_action_type", (e.UnknownActionType, e.ContractInvalid)),
    (9, "idempotency_conflict", (e.IdempotencyConflict,)),
    (8, "envelope_refused", (e.EnvelopeRefused,)),
    (11, "retry_refused", (e.RetryRefused,)),
    (10, "transition_refused", (e.TransitionRefused,)),
    (12, "kill_switch_invalid", (e.KillSwitchInvalid,)),
    (13, "privilege_refused", (e.PrivilegeRefused,)),
    (14, "revalidation_failed", (e.RevalidationFailed,)),
    (15, "follow_timed_out", (e.FollowTimedOut,)),
    (16, "proofline_error", (e.ProoflineError, click.ClickException)),
)

#: What each class of error means, for the reference's table.
MEANING = {
    "usage": "a missing or unknown option, a bad value (`--target` that is not a JSON object, a bad `--since`)",
    "configuration_error": "settings that do not load, missing keys, a schema never migrated (`schema_missing`)",
    "database_unavailable": "the ledger database cannot be reached (or the database does not exist)",
    "broker_unavailable": "the broker cannot be reached; what was recorded stays recorded and the reconciler sends it",
    "not_found": "no such action, run or revocation",
    "unknown_action_type": "no contract for the action type, or its contract file is refused (`contract_invalid`, the file named)",
    "envelope_refused": "the envelope is one every worker would refuse (signature, schema, contract mismatch)",
    "idempotency_conflict": "the action id was already published with other arguments",
    "transition_refused": "the action's state does not allow it (`manual resolve` on an action that is not escalated)",
    "retry_refused": "`retry` refused, with the reason as the code (`retry_not_escalated`, `effect_not_proven_absent`, ...)",
    "kill_switch_invalid": "a kill switch that would block nothing (no value, unknown name, `tool_tenant` without `@tenant`)",
    "privilege_refused": "the database role may not make this change",
    "revalidation_failed": "the envelope is no longer authorised (approval expired, deadline, limits)",
    "follow_timed_out": "`status --follow --timeout` ran out before the action settled",
    "proofline_error": "any other Proofline error; the line names its stable code",
}

#: Rows the table cannot express as a class: for the reference.
OTHER_ROWS = (
    (OK, "ok", "the command did what it says"),
    (CHECK_FAILED, "check_failed", "verify-ledger found a broken chain; contracts check refused a file"),
    (INTERNAL, "internal_error", "a defect in Proofline: run again with --debug for the traceback"),
    (INTERRUPTED, "interrupted", "Ctrl-C"),
)


def classify(exc: BaseException) -> tuple[int, str]:
    """(exit code, stable code) of an exception that ended a command."""
    if isinstance(exc, ValidationError) and exc.title == "Settings":
        return 3, "configuration_error"
    for code, name, classes in TABLE:
        if isinstance(exc, classes):
            return code, exc.code if isinstance(exc, e.ProoflineError) else name
    return INTERNAL, "internal_error"


def one_line(text: str, limit: int = 600) -> str:
    """Any message as one line (driver messages carry newlines and hints)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def message(exc: BaseException) -> str:
    """The human part of the error line."""
    if isinstance(exc, e.ProoflineError):
        return exc.detail
    if isinstance(exc, click.UsageError) and exc.ctx is not None:
        return f"{exc.ctx.command_path}: {exc.format_message()}"
    if isinstance(exc, click.ClickException):
        return exc.format_message()
    if isinstance(exc, ValidationError):
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{exc.title}: {where}: {first['msg']}" if where else f"{exc.title}: {first['msg']}"
    if isinstance(exc, psycopg.OperationalError):
        return f"the ledger database is unreachable: {exc}"
    return f"{type(exc).__name__}: {exc}"


def markdown_table() -> str:
    """The exit code table as Markdown (docs/reference/cli.md)."""
    rows = [(c, n, w) for c, n, w in OTHER_ROWS[:2]]
    rows += [(c, n, MEANING[n]) for c, n, _ in TABLE]
    rows += list(OTHER_ROWS[2:])
    lines = ["| exit | class | raised for |", "|---:|---|---|"]
    lines += [f"| {c} | `{n}` | {w} |" for c, n, w in sorted(rows, key=lambda r: r[0])]
    return "\n".join(lines)
