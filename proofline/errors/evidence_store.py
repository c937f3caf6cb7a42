"""What the protected evidence store refuses. Part of ``proofline.errors``."""

from __future__ import annotations

from proofline.errors import (
    ConfigurationError,
    PrivilegeRefused,
    ProoflineError,
    RevalidationFailed,
)
from proofline.errors.operator import NotFound


class EvidenceCaptureUnavailable(RevalidationFailed):
    """The action's contract captures evidence, but this worker has no usable auditor public key:
    the call is refused before anything is sent (a capture the contract demands is never skipped)."""

    code = "evidence_capture_unavailable"


class AuditorKeyRequired(ConfigurationError):
    """Reading captured evidence needs the auditor's private key (``PROOFLINE_AUDITOR_KEY_FILE``),
    and the key that sealed the capture."""

    code = "auditor_key_required"


class AuditorRoleRequired(PrivilegeRefused):
    """Only the auditor database role (``proofline_auditor``) may read the evidence store; this
    connection's role was refused (``PROOFLINE_AUDITOR_DATABASE_URL``)."""

    code = "auditor_role_required"


class EvidenceCaptureTampered(ProoflineError):
    """A captured item failed authentication: its ciphertext, nonce or ephemeral key was changed,
    it was moved to another action or kind, or it does not match the digest the ledger recorded."""

    code = "evidence_capture_tampered"


class EvidenceCaptureNotFound(NotFound):
    """No captured evidence has this action id or capture id."""

    code = "evidence_capture_not_found"


__all__ = ["AuditorKeyRequired", "AuditorRoleRequired", "EvidenceCaptureNotFound", "EvidenceCaptureTampered",
           "EvidenceCaptureUnavailable"]
