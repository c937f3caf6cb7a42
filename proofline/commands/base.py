"""What every command shares: the group that turns errors into one line and an exit code, the
``--json`` / ``--debug`` switches, output, database connections as a role, and time formatting.

Errors: one line on stderr, ``proofline: <code>: <message>`` (in ``--json`` mode the same as one
JSON object on stderr), and the exit code of its class (``exit_codes.py``). ``--debug`` (or
``PROOFLINE_DEBUG=1``) prints the traceback as well. Output: in ``--json`` mode exactly one JSON
document on stdout; in text mode never JSON.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import click

from proofline.commands import exit_codes
from proofline.report import dash, ts  # noqa: F401 - re-exported for the command modules


class _Mode:
    """Per invocation: set by the group's and each command's ``--json`` / ``--debug`` flags."""

    json = False
    debug = False


MODE = _Mode()


def _set_json(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        MODE.json = True


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        MODE.debug = True


def json_option(hidden: bool = False) -> click.Option:
    return click.Option(["--json"], is_flag=True, expose_value=False, is_eager=True, callback=_set_json,
                        help="print one JSON document on stdout (errors: one JSON line on stderr)", hidden=hidden)


def foreground(cmd: click.Command) -> click.Command:
    """Mark a long-running command (worker, beat, flower, console, dev): it logs as it goes and has
    no document to print, so its help does not offer ``--json`` and the flag is refused when given."""
    cmd.foreground = True  # type: ignore[attr-defined]
    return cmd


def refuse_json(name: str) -> None:
    """What a foreground command does with ``--json``: a usage error (exit 2) that says why."""
    if MODE.json:
        raise click.UsageError(f"{name} runs in the foreground and logs as it goes; --json is not available")


def raw_options(cmd: click.Command) -> click.Command:
    """Mark a command that hands every option to another program (``soak`` to ``ops.soak``, whose
    own ``--json PATH`` must reach it): the group adds no ``--json`` flag to it."""
    cmd.raw_options = True  # type: ignore[attr-defined]
    return cmd


class ProoflineGroup(click.Group):
    """A group whose every command (and sub-group) takes ``--json``, and whose ``main`` reports any
    error as one line with the exit code of its class."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        if not getattr(cmd, "raw_options", False) and not any("--json" in getattr(p, "opts", ()) for p in cmd.params):
            cmd.params.append(json_option(hidden=getattr(cmd, "foreground", False)))
        if isinstance(cmd, click.Group) and not isinstance(cmd, ProoflineGroup):
            cmd.__class__ = ProoflineGroup  # its own sub-commands get --json too
            for sub in list(cmd.commands.values()):
                cmd.add_command(sub)
        super().add_command(cmd, name)

    def group(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cls", ProoflineGroup)
        return super().group(*args, **kwargs)

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        MODE.json = False
        MODE.debug = os.environ.get("PROOFLINE_DEBUG", "") not in ("", "0", "false")
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except (KeyboardInterrupt, click.exceptions.Abort):
            fail_line("interrupted", "interrupted", exit_codes.INTERRUPTED)
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.exceptions.NoArgsIsHelpError as bare:
            click.echo(bare.ctx.get_help())  # a group named without a command: its help, not an error
            sys.exit(0)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - every error becomes one line and a class exit code
            report_error(exc)
        sys.exit(result if isinstance(result, int) else 0)


def report_error(exc: BaseException) -> None:
    code, name = exit_codes.classify(exc)
    if MODE.debug:
        traceback.print_exception(exc, file=sys.stderr)
    text = exit_codes.message(exc)
    if code == exit_codes.INTERNAL and not MODE.debug:
        text += " (a defect: run again with --debug for the traceback)"
    fail_line(name, text, code)


def fail_line(name: str, text: str, code: int) -> None:
    line = exit_codes.one_line(text)
    if MODE.json:
        click.echo(json.dumps({"error": name, "message": line, "exit_code": code}), err=True)
    else:
        click.echo(f"proofline: {name}: {line}", err=True)
    sys.exit(code)


# --- output ----------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat() if value.tzinfo else value.isoformat()
    if isinstance(value, date | Path):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, bytes | memoryview):
        return None  # sealed bytes are never printed
    return str(value)


def to_json(data: Any) -> str:
    return json.dumps(data, default=_plain, indent=2, sort_keys=False)


def emit(data: Any, text: str | Callable[[], str]) -> None:
    """Print the command's result: ``data`` as JSON in ``--json`` mode, else ``text``."""
    if MODE.json:
        click.echo(to_json(data))
        return
    rendered = text() if callable(text) else text
    if rendered:
        click.echo(rendered)


def emit_rows(key: str, rows: list[dict[str, Any]], line: Callable[[dict[str, Any]], str], empty: str) -> None:
    """A listing: ``{key: rows}`` as JSON, else one ``line`` per row, or ``empty`` (a sentence) if none."""
    emit({key: rows}, lambda: "\n".join(line(r) for r in rows) or empty)


# --- inputs ------------------------------------------------------------------------------------------


def json_value(name: str, text: str, *, kind: type = dict) -> Any:
    """A JSON command-line value, or a usage error naming the option."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON ({exc})", param_hint=name) from None
    if not isinstance(value, kind):
        raise click.BadParameter(f"not a JSON {'object' if kind is dict else kind.__name__}", param_hint=name)
    return value


def since_value(text: str | None) -> datetime | None:
    """``--since``: an ISO timestamp (UTC unless it names a zone) or an age like ``90s``, ``15m``, ``2h``, ``7d``."""
    if not text:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return datetime.now(UTC) - timedelta(seconds=float(text[:-1]) * units[text[-1]])
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter("an ISO timestamp (2026-11-30T21:00:00Z) or an age (90s, 15m, 2h, 7d)",
                                 param_hint="--since") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


# --- settings and connections ------------------------------------------------------------------------


def settings():
    from proofline.settings import get_settings

    return get_settings()


def connect(role: str | None = None):
    """A connection as this command's database role: ``controller``, ``operator`` or ``reader`` use
    their own URL when configured; everything else (and an unset URL) uses ``database_url``. A
    database that cannot be reached is ``database_unavailable``; one never migrated is
    ``schema_missing``."""
    import psycopg

    from ledger import store
    from proofline.errors import DatabaseUnavailable, SchemaMissing
    from proofline.settings import reveal

    s = settings()
    url = getattr(s, f"{role}_database_url") if role else None
    try:
        conn = store.connect(reveal(url) or reveal(s.database_url), connect_timeout=10)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to the ledger database as {role or 'the runtime role'}: "
                                  f"{exc_text(exc)}") from None
    try:
        conn.execute("SELECT 1 FROM actions LIMIT 0")
    except psycopg.errors.UndefinedTable:
        conn.close()
        raise SchemaMissing("the ledger database has no Proofline tables: run `proofline migrate`") from None
    return conn


def exc_text(exc: BaseException) -> str:
    return exit_codes.one_line(str(exc), 300)
