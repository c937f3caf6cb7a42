"""Sentry on the worker processes: the Celery integration sends each task as a transaction when
``PROOFLINE_SENTRY_TRACES_SAMPLE_RATE`` is set, with the deployment's environment and release,
and neither transactions nor events carry the action's arguments."""

from __future__ import annotations

from tests.conftest import wait_for
from tests.helpers import ticket_env
from tests.security.test_secrets import SentryReceiver
from tests.telemetry.conftest import RELEASE, Observed


def test_tasks_reach_sentry_as_transactions_with_environment_and_release(observed: Observed,
                                                                         sentry_receiver: SentryReceiver) -> None:
    stack = observed.stack
    env = ticket_env(stack)
    stack.publish(env)
    stack.wait_settled(env.action_id)

    def tasks() -> set[str]:
        names = {t.get("transaction") for t in sentry_receiver.items("transaction")}
        return names if {"proofline.execute", "proofline.verify"} <= names else set()

    wait_for(tasks, 90, what="the tasks' Sentry transactions")
    for item in sentry_receiver.items("transaction"):
        assert (item["environment"], item["release"]) == (stack.settings.environment, RELEASE)
        assert item["contexts"]["trace"]["op"].startswith("queue.")  # made by the Celery integration
    text = "\n".join(sentry_receiver.bodies)
    assert env.arguments["title"] not in text and env.idempotency_key not in text
