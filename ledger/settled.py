"""Settled-action notifications: the ledger says when an action reaches a settled state.

A trigger on ``actions`` (migration 0011) calls ``pg_notify`` on :data:`CHANNEL` with the action id
whenever an action moves into ``closed``, ``cancelled`` or ``escalated`` (or ``proposed``). Postgres delivers the
notification when the transaction that moved the action commits, so a listener never hears of a
state it could not yet read. Notifications are a hint, not a record: a listener that was not
connected misses them, so every waiter also reads the row itself (``proofline/client.py``).
"""

from __future__ import annotations

#: The channel the trigger notifies on; the payload is the action id.
CHANNEL = "proofline_action_settled"

#: The statuses that end a wait: a proven outcome, or an operator's turn (``escalated``).
SETTLED = ("closed", "cancelled", "escalated")
#: The statuses the trigger notifies: the settled ones, and ``proposed`` (an approver's turn, which
#: a waiting controller is told about too; migration 0015 re-creates the trigger with it).
NOTIFIED = (*SETTLED, "proposed")

TRIGGER = f"""
CREATE FUNCTION proofline_notify_settled() RETURNS trigger LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
  IF NEW.status::text IN ({", ".join(f"'{s}'" for s in NOTIFIED)})
     AND (TG_OP = 'INSERT' OR OLD.status IS DISTINCT FROM NEW.status) THEN
    PERFORM pg_notify('{CHANNEL}', NEW.action_id);
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER actions_notify_settled AFTER INSERT OR UPDATE OF status ON actions
  FOR EACH ROW EXECUTE FUNCTION proofline_notify_settled();
"""

DROP = """
DROP TRIGGER actions_notify_settled ON actions;
DROP FUNCTION proofline_notify_settled();
"""
