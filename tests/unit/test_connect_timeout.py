"""The time a new MCP session may take to open is a setting, and it reaches the process's sessions."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from proofline.settings import Settings
from worker.mcp_client import CONNECT_TIMEOUT_SECONDS, close_sessions
from worker.runtime import Runtime


def test_the_setting_reaches_the_sessions_a_worker_opens() -> None:
    close_sessions()  # this process's sessions are built once, from the first runtime that asks
    try:
        rt = Runtime(Settings(mcp_connect_timeout_seconds=42), os.getpid())
        assert rt.mcp.connect_timeout == 42
    finally:
        close_sessions()
    try:
        assert Runtime(Settings(), os.getpid()).mcp.connect_timeout == CONNECT_TIMEOUT_SECONDS == 15.0
    finally:
        close_sessions()


@pytest.mark.parametrize("bad", [0, -1, 601, "soon"])
def test_a_connect_timeout_out_of_range_is_refused(bad: object) -> None:
    with pytest.raises(ValidationError, match="mcp_connect_timeout_seconds"):
        Settings(mcp_connect_timeout_seconds=bad)
