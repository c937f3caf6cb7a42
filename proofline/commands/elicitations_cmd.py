"""Questions tool servers asked mid-call, routed to approvers (``server_requests: {elicitation:
approver}``): list them, read one, answer it with an approver key."""

from __future__ import annotations

import json
from pathlib import Path

import click

from proofline.commands.authority_cmd import KEY_OPTION, _approver_key
from proofline.commands.base import connect, emit, emit_rows, settings, ts


@click.group()
def elicitations() -> None:
    """Questions servers asked mid-call, waiting for an approver's answer."""


@elicitations.command("list")
def elicitations_list() -> None:
    """Questions nobody has answered yet, oldest first."""
    from recovery.elicitation_answers import waiting

    with connect("reader") as conn:
        rows = waiting(conn)
    emit_rows("elicitations", rows, lambda r: f"{r['elicitation_id']}  {ts(r['asked_at'])}  "
              f"{r['question'].get('server')}  {r['question'].get('action_id')}: {r['question'].get('message')}",
              "no question is waiting for an approver")


@elicitations.command("show")
@click.argument("elicitation_id")
def elicitations_show(elicitation_id: str) -> None:
    """One question: the server, the action in flight, the message, the schema an answer must meet."""
    from recovery.elicitation_answers import show

    with connect("reader") as conn:
        found = show(conn, elicitation_id)
    q = found["question"]
    emit(found, "\n".join([
        f"elicitation {elicitation_id} ({found['state']}), asked {ts(found['asked_at'])} by {q.get('server')} "
        f"during {q.get('action_id')}; waits at most {q.get('wait_seconds')} s",
        str(q.get("message")), "answer schema:", json.dumps(q.get("requested_schema"), indent=2, sort_keys=True),
        *([f"answered {found['answer']['action']} by {found['answer']['approver']}"] if found["answer"] else [])]))


@elicitations.command("answer")
@click.argument("elicitation_id")
@KEY_OPTION
@click.option("--accept", "content", metavar="JSON", default=None,
              help="accept, with this JSON object as the answer (it must meet the requested schema)")
@click.option("--decline", is_flag=True, help="decline to answer")
def elicitations_answer(elicitation_id: str, key_file: Path, content: str | None, decline: bool) -> None:
    """Answer a question with your approver key: accept with content, or decline."""
    from recovery.elicitation_answers import answer

    if (content is None) == (not decline):
        raise click.UsageError("give exactly one of --accept JSON or --decline")
    parsed = None
    if content is not None:
        try:
            parsed = json.loads(content)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--accept") from None
        if not isinstance(parsed, dict):
            raise click.BadParameter("the answer is a JSON object", param_hint="--accept")
    s, key = settings(), _approver_key(key_file)
    with connect("operator") as conn:
        result = answer(s, conn, elicitation_id, key, accept=not decline, content=parsed)
    emit(result, f"elicitation {elicitation_id}: {result['action']} by {result['approver']} "
                 f"(action {result['action_id']})")


COMMANDS = (elicitations,)
