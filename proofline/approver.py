"""The approver's SDK: what ``proofline approve``, ``deny``, ``proposals``, ``approvals`` and
``authority`` do on the command line, for an approval service written in Python.

    from proofline.approver import Approver

    with Approver(key_file="/secure/alice.key") as approver:
        for proposal in approver.proposals():
            plan = approver.proposal(proposal["action_id"])["plan"]
            if looks_right(plan):
                approver.approve(proposal["action_id"], note="checked against the CMDB")

It connects as the operator database role (``PROOFLINE_OPERATOR_DATABASE_URL``) and signs with the
approver key it was given: the key never leaves this process. Every refusal is a Proofline error
with its stable code (``proposal_refused``, ``promotion_refused``, ``not_found``, ...).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ledger import store
from proofline.approvals import ApprovalScope, sign_approval, statement_for
from proofline.authority import AuthorityMode, AuthorityPolicy, policy_in_force, sign_policy
from proofline.canonical import sha256_hex
from proofline.envelope import Envelope
from proofline.keys import KeyRole, load_keyring, load_signing_key
from proofline.settings import Settings, get_settings, reveal
from recovery import authority_watch, proposals


class Approver:
    """One approver (their key) acting on the ledger through the operator role."""

    def __init__(self, key_file: Path | str, settings: Settings | None = None, *, app: Any = None,
                 database_url: str | None = None) -> None:
        self.settings = settings or get_settings()
        self.key = load_signing_key(Path(key_file), KeyRole.approver, self.settings.environment)
        entry = load_keyring(self.settings.keyring_file, self.settings.environment).get(self.key.key_id)
        self.identity = (entry.identity if entry else None) or self.key.key_id
        self._url = (database_url or reveal(self.settings.operator_database_url) or reveal(self.settings.database_url))
        self._conn = store.connect(self._url)
        self._app = app

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Approver:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- approvals carried by an envelope (mode approved) ----------------------------------------
    def sign(self, envelope: Envelope, *, ttl: timedelta = timedelta(hours=1), covers_irreversible: bool = False,
             max_amount_cents: int | None = None, for_action: bool = True) -> dict[str, Any]:
        """A signed approval of exactly ``envelope``'s intent, for the controller to carry."""
        statement = statement_for(envelope, approver=self.identity, ttl=ttl, for_action=for_action,
                                  scope=ApprovalScope(covers_irreversible=covers_irreversible,
                                                      max_amount_cents=max_amount_cents))
        return sign_approval(statement, self.key)

    def revoke(self, approval_id: str, reason: str) -> bool:
        return proposals.revoke_approval(self._conn, approval_id, self.identity, reason)

    def revoked(self) -> list[dict[str, Any]]:
        return proposals.list_revoked_approvals(self._conn)

    # --- proposals (mode propose) -----------------------------------------------------------------
    def proposals(self) -> list[dict[str, Any]]:
        return proposals.list_proposals(self._conn)

    def proposal(self, action_id: str) -> dict[str, Any]:
        return proposals.proposal(self._conn, action_id)

    def approve(self, action_id: str, *, ttl: timedelta = timedelta(hours=1), covers_irreversible: bool = False,
                max_amount_cents: int | None = None, note: str = "") -> dict[str, Any]:
        from worker.dispatch import CeleryDispatch

        return proposals.approve(self.settings, self._conn, CeleryDispatch(self._celery()), action_id, self.key,
                                 ttl=ttl, covers_irreversible=covers_irreversible,
                                 max_amount_cents=max_amount_cents, note=note)

    def deny(self, action_id: str, reason: str) -> dict[str, Any]:
        return proposals.deny(self._conn, action_id, self.identity, reason)

    # --- authority --------------------------------------------------------------------------------
    def status(self, action_type: str | None = None, window: timedelta | None = None) -> list[dict[str, Any]]:
        loaded = self._policy()
        days = loaded.policy.promotion.window_days if loaded else 30
        return authority_watch.evidence(self._conn, action_type, window or timedelta(days=days), datetime.now(UTC))

    def promote(self, action_type: str, to: AuthorityMode | str, out: Path | None = None) -> dict[str, Any]:
        """Promote when the evidence holds (else ``promotion_refused``); writes the newly signed
        policy to ``out`` (default: the policy file in force) and ledgers the promotion."""
        import json

        loaded = self._policy()
        target = out or self.settings.authority_file
        if loaded is None or target is None:
            from proofline.errors import PromotionRefused

            raise PromotionRefused("no authority policy is in force: nothing to promote")
        policy, proof = authority_watch.promoted(self._conn, loaded, action_type, AuthorityMode(to), datetime.now(UTC))
        signed = self.sign_policy(policy)
        tmp = Path(target).with_name(f".{Path(target).name}.tmp")
        tmp.write_text(json.dumps(signed, indent=2) + "\n")
        tmp.replace(target)
        authority_watch.record_promotion(self._conn, self.identity, proof, sha256_hex(signed["policy"]))
        return {**proof, "policy_version": policy.version, "wrote": str(target)}

    def sign_policy(self, policy: AuthorityPolicy) -> dict[str, Any]:
        return sign_policy(policy, self.key)

    def _policy(self):
        s = self.settings
        return policy_in_force(s)

    def _celery(self) -> Any:
        if self._app is None:
            from proofline.client import celery_app

            self._app = celery_app(self.settings, "proofline-approver")
        return self._app
