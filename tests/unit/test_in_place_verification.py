"""Which classified calls the execute task may verify in place (pure logic; the end-to-end proof
is in tests/integration/test_core_path.py and tests/faults/test_worker_crashes.py)."""

from __future__ import annotations

import pytest

from ledger.states import Outcome
from proofline.settings import Settings
from worker.classify import Classification
from worker.verification import decides_in_place

ON, OFF = Settings(inline_verification=True), Settings(inline_verification=False)


def test_a_completed_call_with_values_is_verified_in_place() -> None:
    verdict = Classification(Outcome.completed_unverified, "server_reported_success", values={"id": "t-1"})
    assert decides_in_place(ON, verdict)
    assert not decides_in_place(OFF, verdict)


@pytest.mark.parametrize("outcome", [o for o in Outcome if o != Outcome.completed_unverified])
def test_every_other_outcome_goes_to_the_verification_task(outcome: Outcome) -> None:
    assert not decides_in_place(ON, Classification(outcome, "x", values={"id": "t-1"}))


@pytest.mark.parametrize("values", [None, {}])
def test_a_call_without_values_goes_to_the_task_which_recovers_them(values) -> None:
    assert not decides_in_place(ON, Classification(Outcome.completed_unverified, "x", values=values))


def test_a_call_with_a_downstream_operation_goes_to_the_task() -> None:
    verdict = Classification(Outcome.completed_unverified, "x", values={"id": "t-1"}, operation_id="op-1")
    assert not decides_in_place(ON, verdict)


def test_the_setting_reads_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROOFLINE_INLINE_VERIFICATION", "false")
    assert Settings().inline_verification is False
    monkeypatch.delenv("PROOFLINE_INLINE_VERIFICATION")
    assert Settings().inline_verification is True
