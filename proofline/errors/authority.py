"""Authority refusals: signed approvals, the authority policy, plans (``proofline/approvals.py``,
``proofline/authority.py``, ``worker/authorize.py``). Part of ``proofline.errors``."""

from __future__ import annotations

from proofline.errors import RevalidationFailed


class ApprovalMissing(RevalidationFailed):
    """The action's authority mode needs a signed approval and it carries none."""

    code = "approval_missing"


class ApprovalSignatureInvalid(RevalidationFailed):
    """An approval is malformed, or signed by an unknown or revoked key, or its signature is wrong."""

    code = "approval_signature_invalid"


class ApprovalWrongRole(RevalidationFailed):
    """An approval is signed by a key that may not approve (a controller, worker or recovery key)."""

    code = "approval_wrong_role"


class ApprovalMismatch(RevalidationFailed):
    """An approval approves another intent (arguments, target, plan, tool, tenant or approver)."""

    code = "approval_mismatch"


class ApprovalRevoked(RevalidationFailed):
    """An approval was revoked before the action was sent."""

    code = "approval_revoked"


class ApprovalScopeExceeded(RevalidationFailed):
    """An approval's scope does not cover what the action does (a point of no return, an amount)."""

    code = "approval_scope_exceeded"


class ApproversInsufficient(RevalidationFailed):
    """Fewer distinct approvers signed than the authority policy requires."""

    code = "approvers_insufficient"


class AuthorityModeRefused(RevalidationFailed):
    """The action type's authority mode does not allow this action (a write in ``read`` mode)."""

    code = "authority_mode_refused"


class PlanChanged(RevalidationFailed):
    """The plan prepared right before the commit is not the plan that was approved."""

    code = "plan_changed"


class AuthorityPolicyInvalid(RevalidationFailed):
    """The authority policy file is missing where required, unsigned, or not signed by an approver."""

    code = "authority_policy_invalid"
