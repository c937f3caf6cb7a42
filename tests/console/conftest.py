"""The console against the real stack: ``proofline console`` as its own process (reader and operator
database roles from the stack's environment), and Debian's Chromium driven by Playwright.

Every page a test opens is saved as a PNG under ``tests/console/screenshots/`` (ignored by git;
docs/design/tests.md names it), so a reviewer can look at what the tests saw.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from proofline.console.access import ConsoleRole, add_user
from proofline_kit.processes import start_process, stop_process, wait_port_file
from tests.conftest import Stack

SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"
CHROMIUM = os.environ.get("PROOFLINE_TEST_CHROMIUM", "/usr/bin/chromium")


class Console:
    """The running console: its URL and the users a test logs in as (name -> token)."""

    def __init__(self, url: str, tokens: dict[str, str], log: Path) -> None:
        self.url, self.tokens, self.log = url, tokens, log


@contextmanager
def running_console(stack: Stack, users: Path, tokens: dict[str, str]) -> Iterator[Console]:
    """``proofline console`` on ``stack`` as its own process, serving the users in ``users``."""
    port_file = stack.workdir / "ports" / "console.port"
    log = stack.workdir / "console.log"
    proc = start_process([sys.executable, "-m", "proofline", "console", "--port", "0", "--port-file", str(port_file),
                          "--users", str(users)], stack.env, log)
    try:
        port = wait_port_file(port_file, proc)
        yield Console(f"http://127.0.0.1:{port}", tokens, log)
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def console(stack: Stack) -> Iterator[Console]:
    users = stack.workdir / "console-users.json"
    tokens = {"ops-alice": add_user(users, "ops-alice", ConsoleRole.operator),
              "viewer-bob": add_user(users, "viewer-bob", ConsoleRole.viewer)}
    with running_console(stack, users, tokens) as running:
        yield running


@contextmanager
def chromium(stack: Stack) -> Iterator[Any]:
    """Debian's Chromium under Playwright, for one test module. Playwright's sync API keeps an
    asyncio loop running in this thread while it is open, which would break any later test that
    calls ``asyncio.run``: so it is closed after each module, not held for the session."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (bash .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(exist_ok=True)
    # The controller's probe of the live server (asyncio.run) must happen before Playwright's loop
    # starts; the stack caches what it found.
    stack.live()
    with sync_playwright() as driver:
        # Debian's Chromium, never a browser Playwright downloads; as root it needs --no-sandbox.
        launched = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def browser(stack: Stack) -> Iterator[Any]:
    with chromium(stack) as launched:
        yield launched


def log_in(browser: Any, console: Console, user: str) -> Any:
    """A fresh browser context (its own cookies) logged in as ``user``; returns its page."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, base_url=console.url)
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.goto("/login")
    page.fill("input[name=user]", user)
    page.fill("input[name=token]", console.tokens[user])
    page.click("button:has-text('log in')")
    page.wait_for_url(f"{console.url}/?*")
    return page


def shot(page: Any, name: str) -> Path:
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SCREENSHOTS.exists() and any(SCREENSHOTS.glob("*.png")):
        terminalreporter.write_line(f"console screenshots: {SCREENSHOTS}")
