"""The re-check schedule of a contract: durations, the ``verification.recheck`` block's rules, and
``proofline contracts check`` naming a bad one."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from proofline.contracts import load_contract, scan_contracts
from proofline.recheck import Recheck, parse_duration
from proofline.settings import ROOT


@pytest.mark.parametrize(("text", "seconds"), [
    ("2s", 2.0), ("5m", 300.0), ("1h", 3600.0), ("1d", 86400.0), ("1h30m", 5400.0), ("1.5s", 1.5),
    ("250ms", 0.25), (" 10S ", 10.0), (3, 3.0), (0.5, 0.5),
])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "5 minutes", "-5m", "5x", "m5", "1h-30m", True, None, [1]])
def test_bad_durations_are_refused(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_offsets_and_horizon():
    r = Recheck.model_validate({"at": ["5m", "1h"], "horizon": "2h"})
    assert (r.at, r.horizon_seconds) == ((300.0, 3600.0), 7200.0)
    assert Recheck.model_validate({"at": ["2s", "4s"]}).horizon_seconds == 4.0


@pytest.mark.parametrize(("block", "says"), [
    ({"at": ["1h", "5m"], "horizon": "2h"}, "strictly ascending"),
    ({"at": ["5m", "5m"], "horizon": "2h"}, "strictly ascending"),
    ({"at": ["0s"], "horizon": "1h"}, "positive"),
    ({"at": [-3], "horizon": "1h"}, "positive"),
    ({"at": ["5m", "3h"], "horizon": "2h"}, "past the horizon"),
    ({"at": ["5m"], "horizon": "90d"}, "horizon must be positive"),
    ({"at": [], "horizon": "1h"}, "at least 1"),
    ({"at": ["5 min"]}, "not a duration"),
    ({"at": ["5m"], "every": "1m"}, "Extra inputs"),
])
def test_bad_schedules_are_refused(block, says):
    with pytest.raises(ValidationError, match=says):
        Recheck.model_validate(block)


def _contract_with(tmp_path, recheck):
    spec = yaml.safe_load((ROOT / "contracts" / "ticket.close.yaml").read_text())
    spec["verification"]["recheck"] = recheck
    path = tmp_path / "ticket.close.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_a_contract_carries_its_schedule(tmp_path):
    contract = load_contract(_contract_with(tmp_path, {"at": ["2s", "4s"], "horizon": "6s"}))
    assert contract.verification.recheck is not None
    assert contract.verification.recheck.at == (2.0, 4.0)


def test_contracts_check_names_a_bad_schedule(tmp_path):
    _contract_with(tmp_path, {"at": ["1h", "5m"], "horizon": "2h"})
    found = scan_contracts(tmp_path)
    [(name, reason)] = found.broken.values()
    assert name == "ticket.close.yaml"
    assert "verification.recheck" in reason and "ascending" in reason
