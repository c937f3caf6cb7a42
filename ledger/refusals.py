"""Recording refusals must itself be total: any input, however hostile, leaves a writable record.

Evidence about input nobody verified goes through :func:`proofline.bounded.safe` first (see there
for why), is redacted, and is appended to a refusal chain; should it still not be writable, a
minimal record that names the failure is written instead of none.
"""

from __future__ import annotations

import logging
from typing import Any

from ledger import store
from ledger.redact import Redactor
from proofline.bounded import safe, safe_str

log = logging.getLogger(__name__)


def record(conn: Any, chain: str, event: str, actor: str, evidence: dict[str, Any],
           redactor: Redactor | None = None) -> None:
    """Append one event about untrusted input. The evidence is made safe first, then redacted (the
    policy, plus ``redactor``'s declarations); should it still not be writable, a minimal record
    that names the failure is written instead of none."""
    clean = safe(evidence)
    try:
        with store.transaction(conn) as cur:
            store.append_event_txn(cur, safe_str(chain, 200), event, safe_str(actor, 200), clean, redactor or ())
    except Exception as exc:  # noqa: BLE001 - second chance with evidence that is certainly writable
        if conn.closed or conn.broken:
            raise
        log.error("refusal evidence not writable; recording a minimal one",
                  extra={"event": "refusal_minimal", "error": type(exc).__name__})
        minimal = {"reason_code": safe_str(str(evidence.get("reason_code", "unknown")), 80),
                   "evidence_unwritable": type(exc).__name__}
        with store.transaction(conn) as cur:
            store.append_event_txn(cur, safe_str(chain, 200), event, safe_str(actor, 200), minimal)
