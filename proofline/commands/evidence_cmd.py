"""``proofline evidence show``: the auditor reads the protected evidence store.

It needs the auditor's private key (``PROOFLINE_AUDITOR_KEY_FILE``) and the auditor's database role
(``PROOFLINE_AUDITOR_DATABASE_URL``); without either it refuses (``auditor_key_required``,
``auditor_role_required``) before anything is decrypted. Every read is recorded on the action's
chain as ``evidence_read_by_auditor``, in the transaction that read the rows.
"""

from __future__ import annotations

import getpass
import json
import socket

import click

from proofline.commands.base import MODE, connect, settings, to_json


@click.group()
def evidence() -> None:
    """The protected evidence store (auditors only)."""


@evidence.command("show")
@click.argument("action_id", required=False)
@click.option("--capture", "capture_id", help="read one capture by its id instead of an action's")
@click.option("--reader", default=None, help="who reads, as the ledger records it (default: user@host)")
def show(action_id: str | None, capture_id: str | None, reader: str | None) -> None:
    """Decrypt and print an action's captured arguments, results and reads (or one capture), and
    record the read in the ledger."""
    from ledger import vault_store
    from proofline.auditor_keys import load_private

    if (action_id is None) == (capture_id is None):
        raise click.UsageError("name an ACTION_ID or --capture ID (one of the two)")
    key = load_private(settings())  # no key, nothing read: refused before the database is asked
    who = reader or f"{getpass.getuser()}@{socket.gethostname()}"
    with connect("auditor") as conn:
        opened = vault_store.read(conn, key, who, action_id=action_id, capture_id=capture_id, via="cli")
    if MODE.json:
        click.echo(to_json({"reader": who, "captures": [o.as_json() for o in opened]}))
        return
    for o in opened:
        click.echo(f"{o.capture_id}  {o.kind}  action {o.action_id}  retention {o.retention}  "
                   f"captured {o.captured_at:%Y-%m-%d %H:%M:%S} by {o.captured_by}  {o.plaintext_sha256}")
        click.echo("  " + json.dumps(o.value, indent=2, sort_keys=True, default=str).replace("\n", "\n  "))
    click.echo(f"read recorded in the ledger as evidence_read_by_auditor by {who}")


COMMANDS = (evidence,)
