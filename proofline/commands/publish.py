"""``proofline publish``: build, sign, record and send one envelope, as the controller role."""

from __future__ import annotations

import json
from pathlib import Path

import click

from proofline.commands.base import connect, emit, json_value, settings


@click.command()
@click.option("--action-type", required=True)
@click.option("--tenant", required=True)
@click.option("--target", "target_json", required=True, help='JSON, e.g. {"type":"ticket","id":"T-1","expected_version":2}')
@click.option("--args", "args_json", required=True, help="tool arguments as JSON")
@click.option("--run-id", default=None, help="default: the action's own run, run-<action id>")
@click.option("--action-id", default=None, help="default: a fresh act-<uuid>, printed")
@click.option("--requester", default=None,
              help="who requests it (default PROOFLINE_REQUESTER, else the user and host that publish)")
@click.option("--workload-identity", default=None,
              help="the agent's identity (default PROOFLINE_WORKLOAD_IDENTITY, else proofline-controller:USER@HOST)")
@click.option("--approval", "approval_files", multiple=True, type=click.Path(path_type=Path, dir_okay=False),
              help="an approval signed by an approver (`proofline approvals sign`); repeat for two approvers")
def publish(action_type, tenant, target_json, args_json, run_id, action_id, requester, workload_identity,
            approval_files) -> None:
    """Build, sign and publish one envelope onto the actions queue. The controller's signature
    requests the action; approvals come from approvers (``--approval``) or the authority policy."""
    from proofline.controller import fresh_ids, prepare
    from proofline.controller import publish as do_publish
    from proofline.keys import check_process_keys
    from proofline.telemetry import tracing
    from worker.tasks import app

    target, arguments = json_value("--target", target_json), json_value("--args", args_json)
    approvals = []
    for path in approval_files:
        try:
            approvals.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise click.BadParameter(f"{path}: not a readable JSON approval ({exc})", param_hint="--approval") from None
    s = settings()
    check_process_keys(s, "controller")  # before anything is recorded
    run_id, action_id = fresh_ids(run_id, action_id)
    # Arguments against the pinned input schema (arguments_invalid), then the envelope's own fields
    # (envelope_malformed): both refused here, before anything is signed or recorded.
    envelope = prepare(s, action_type=action_type, arguments=arguments, target=target, tenant=tenant,
                       run_id=run_id, action_id=action_id, requester=requester, workload_identity=workload_identity,
                       approvals=tuple(approvals))
    # The action's trace starts here when OTEL_TRACES_EXPORTER names an exporter (nothing otherwise):
    # the controller's span, its statements, and the context the message carries to the worker.
    tracing.setup("proofline-controller", s.environment, s.release)
    try:
        with connect("controller") as conn:
            # A broker that does not take the message raises broker_unavailable (exit 5); the record stays.
            result = do_publish(s, conn, app, envelope)
    finally:
        tracing.shutdown()  # exports the spans before the process exits
    emit(result, f"published {result['action_id']} (task {result['task_id']})" if not result["republished"]
         else f"{result['action_id']} was already published with these arguments: sent again (task {result['task_id']})")


COMMANDS = (publish,)
