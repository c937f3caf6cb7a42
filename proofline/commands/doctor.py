"""``proofline doctor``: is this deployment able to run actions, and if not, what to do about it.

One line per check (``ok`` or ``FAIL``, what was found, and for a failure how to fix it), exit 1 if
any check failed, ``--json`` for machines. Every check runs even when an earlier one failed, so
one run lists everything that is wrong. Checks: the production rules (not root, a broker URL with
credentials, no private key of another role readable, no runtime role let into Postgres without a
password, a broker that asks for credentials), the database, its migrations, the broker, the reconciler's heartbeat, the keys this
process role needs, the contracts and their pins, an auditor key for contracts that capture
evidence, the servers file and what its sandboxes need on
this host. The checks themselves live in
``proofline/setup_checks.py``: ``proofline worker`` runs the same ones before it starts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict

import click

from proofline.production_checks import check_broker_auth, check_database_auth, check_key_files
from proofline.settings import Settings, get_settings
from proofline.setup_checks import (
    NEEDS_DATABASE,
    Check,
    Failed,
    check_authority,
    check_broker,
    check_contracts,
    check_database,
    check_environment,
    check_evidence_capture,
    check_keys,
    check_migrations,
    check_pins,
    check_reconciler,
    check_servers,
)


def run_checks(settings: Settings, role: str) -> list[Check]:
    checks: list[tuple[str, Callable[[], str]]] = [
        ("environment", lambda: check_environment(settings)),
        ("key-files", lambda: check_key_files(settings, role)),
        ("database", lambda: check_database(settings)),
        ("db-auth", lambda: check_database_auth(settings)),
        ("migrations", lambda: check_migrations(settings)),
        ("broker", lambda: check_broker(settings)),
        ("broker-auth", lambda: check_broker_auth(settings)),
        ("reconciler", lambda: check_reconciler(settings)),
        ("keys", lambda: check_keys(settings, role)),
        ("authority", lambda: check_authority(settings)),
        ("contracts", lambda: check_contracts(settings)),
        ("evidence_capture", lambda: check_evidence_capture(settings)),
        ("pins", lambda: check_pins(settings, publishing=role in ("controller", "all"))),
        ("servers", lambda: check_servers(settings)),
    ]
    results: list[Check] = []
    for name, check in checks:
        if name in NEEDS_DATABASE and not next(r.ok for r in results if r.name == "database"):
            results.append(Check(name, False, "not checked: the database is unreachable",
                                 "fix the database check first"))
            continue
        try:
            results.append(Check(name, True, check()))
        except Failed as exc:
            results.append(Check(name, False, exc.detail, exc.fix))
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check, not a traceback
            results.append(Check(name, False, f"{type(exc).__name__}: {str(exc).strip()[:300]}",
                                 "unexpected: correct the setting it names, or report it"))
    return results


@click.command()
@click.option("--role", type=click.Choice(["execute", "recovery", "all", "controller"]), default="all",
              show_default=True, help="which process's keys to check")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of lines")
def doctor(role: str, as_json: bool) -> None:
    """Check the database and its migrations, the broker, the reconciler's heartbeat, keys, contracts,
    pins and servers (with their sandbox); one line each, exit 1 if any failed."""
    settings = get_settings()  # settings that do not load: one line, exit 3 (configuration_error)
    results = run_checks(settings, role)
    if as_json:
        click.echo(json.dumps({"ok": all(r.ok for r in results), "checks": [asdict(r) for r in results]}, indent=2))
    else:
        for result in results:
            click.echo(result.line())
    sys.exit(0 if all(r.ok for r in results) else 1)
