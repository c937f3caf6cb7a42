"""The operator console: server-rendered pages over the ledger (actions, one action's evidence,
runs, the manual queue, kill switches and revocations, an overview with plots), for viewers and
operators. ``proofline console`` serves it (``proofline/commands/console_cmd.py``)."""
