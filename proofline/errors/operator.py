"""What operators, the CLI, the SDK and the console are refused. Part of ``proofline.errors``."""

from __future__ import annotations

from proofline.errors import ConfigurationError, ProoflineError


class NotFound(ProoflineError):
    """No action, run or record has this id."""

    code = "not_found"


class PromotionRefused(ProoflineError):
    """An action type may not move up a rung: the ledger's evidence does not meet the policy's thresholds."""

    code = "promotion_refused"


class ProposalRefused(ProoflineError):
    """An approval or denial of a proposal was refused (not proposed, not an approver, approved twice)."""

    code = "proposal_refused"


class DatabaseUnavailable(ProoflineError):
    """The ledger database could not be reached (or refused the connection)."""

    code = "database_unavailable"
    retryable = True


class SchemaMissing(ConfigurationError):
    """The ledger database has no Proofline schema yet (run ``proofline migrate``)."""

    code = "schema_missing"


class BrokerUnavailable(ProoflineError):
    """The broker could not be reached; what was recorded in the ledger stays recorded."""

    code = "broker_unavailable"
    retryable = True


class KillSwitchInvalid(ProoflineError):
    """A kill switch's scope and value would block nothing (no value, an unknown tool, server,
    action type or tenant, a ``tool_tenant`` value without ``@tenant``): it is refused instead of
    being shown as engaged."""

    code = "kill_switch_invalid"


class FollowTimedOut(ProoflineError):
    """The action did not reach a settled state within the time given to follow it."""

    code = "follow_timed_out"


class RetryRefused(ProoflineError):
    """An operator retry is refused: only an escalated action whose effect is proven absent, still
    wanted, inside its deadline and its call budget, is sent again (same envelope, same key)."""

    code = "retry_refused"


class RetryNotEscalated(RetryRefused):
    """The action is not escalated: the runtime (or an operator) still owns or already settled it."""

    code = "retry_not_escalated"


class EffectNotProvenAbsent(RetryRefused):
    """Nothing proves the action's effect absent: sending it again could apply it twice."""

    code = "effect_not_proven_absent"


class RetryNotWanted(RetryRefused):
    """A cancellation was requested, or the action's run failed: it must not run again."""

    code = "retry_not_wanted"


class RetryExpired(RetryRefused):
    """The action's deadline or approval has passed (or leaves no time for one more call)."""

    code = "retry_expired"


class RetryBudgetExhausted(RetryRefused):
    """Every tool call the approval allows has been made."""

    code = "retry_budget_exhausted"


# --- the controller SDK and its pinned tool contracts ----------------------------------------------


class ContractNotPinned(ConfigurationError):
    """No reviewed tool contract hash is pinned for this action type (``proofline contracts pin``)."""

    code = "contract_not_pinned"


class UnknownServer(ConfigurationError):
    """A contract names a server (an evidence source's) that the servers file does not define."""

    code = "unknown_server"


class WaitTimedOut(ProoflineError):
    """The action had not reached a settled state when the wait ran out (it keeps running)."""

    code = "wait_timed_out"
    retryable = True


class ServersVariableUnset(ConfigurationError):
    """The servers file names an environment variable (``${NAME}``) that is not set."""

    code = "servers_variable_unset"


# --- the operator console ---------------------------------------------------------------------------


class ConsoleForbidden(ProoflineError):
    """The console refused a write: no session, or a viewer's session (only an operator acts)."""

    code = "console_forbidden"


class CsrfRefused(ConsoleForbidden):
    """A console write did not carry its session's CSRF token: it may come from another site."""

    code = "csrf_refused"


class ConsoleInputInvalid(ProoflineError):
    """A console form or filter was sent without what it needs (a reason, a resolution, a scope) or
    with a value it cannot use (a time that is not one, evidence that is not a JSON object)."""

    code = "console_input_invalid"


# --- a deployment folder (proofline init, proofline dev) -------------------------------------------


class InitFolderNotEmpty(ConfigurationError):
    """``proofline init`` was pointed at a folder that already holds files: nothing was written
    (pass --force to write the deployment's files over what is there)."""

    code = "init_folder_not_empty"


class NotADeploymentFolder(ConfigurationError):
    """``proofline dev`` was run where ``proofline init`` made no deployment folder (no .env,
    servers.yaml, keys or signed authority policy)."""

    code = "dev_not_a_deployment_folder"


class DevStackFailed(ConfigurationError):
    """A process of the ``proofline dev`` stack exited or did not come up: the whole stack was stopped."""

    code = "dev_stack_failed"


class DevAlreadyRunning(ConfigurationError):
    """``proofline dev`` already runs the stack of this folder (in another terminal): a second one
    would share its Postgres and stop it on the way out. Nothing was started."""

    code = "dev_already_running"



class ElicitationRefused(ProoflineError):
    """An answer to a server's elicitation was refused: not pending (answered, expired, unknown), signed
    by a key that may not answer, not matching the question, or content outside its requested schema."""

    code = "elicitation_refused"


class ReadRefused(ProoflineError):
    """A gateway read was refused: its task was unsigned, signed by a key that may not ask for reads,
    tampered with, not the request the ledger recorded, or already answered."""

    code = "read_refused"
