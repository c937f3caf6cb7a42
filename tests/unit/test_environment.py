"""The environment is one of four exact values: any other spelling is refused when the settings
load, so nothing can run with the production rules silently off. In production two more start-up
rules apply (proofline/setup_checks.py): not as root, and a broker URL that carries a password."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from proofline.settings import Environment, Settings
from proofline.setup_checks import Failed, check_environment
from worker.sandbox import SandboxSpec, require_policy


@pytest.mark.parametrize("spelling", ["prod", "Production", "production ", " production", "PRODUCTION", "dev", ""])
def test_any_other_spelling_is_refused(spelling: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(environment=spelling)
    first = refused.value.errors(include_url=False)[0]
    assert first["loc"] == ("environment",)
    assert repr(spelling) in first["msg"] and "development, test, staging, production" in first["msg"]


def test_the_four_environments_load_as_members() -> None:
    assert [e.value for e in Environment] == ["development", "test", "staging", "production"]
    for member in Environment:
        loaded = Settings(environment=member.value).environment
        assert loaded is member and str(loaded) == member.value


def test_only_production_turns_the_sandbox_rule_on() -> None:
    bare = SandboxSpec(enabled=False)
    for env in (Environment.development, Environment.test, Environment.staging):
        assert require_policy("sor", "write", bare, Settings(environment=env).environment) is not None
    with pytest.raises(Exception, match="unsandboxed in production"):
        require_policy("sor", "write", bare, Settings(environment="production").environment)


def test_outside_production_the_extra_rules_are_off() -> None:
    found = check_environment(Settings(environment="staging", broker_url="redis://127.0.0.1:6379/0"))
    assert found.startswith("staging: the production rules are off")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "amqp://guest@127.0.0.1:5672//",
                                 "rediss://user@redis.internal:6380/0",
                                 # a cluster's list: one node's URL without the password is enough
                                 "amqp://pl:s3cret@mq1:5672/pl;amqp://pl@mq2:5672/pl;amqp://pl:s3cret@mq3:5672/pl"])
def test_production_refuses_a_broker_url_without_a_password(url: str) -> None:
    with pytest.raises(Failed) as refused:
        check_environment(Settings(environment="production", broker_url=url))
    assert "carries no password" in refused.value.detail and "PASSWORD" in refused.value.fix


def test_production_refuses_root() -> None:
    settings = Settings(environment="production", broker_url="redis://:s3cret@127.0.0.1:6379/0")
    if os.geteuid() == 0:
        with pytest.raises(Failed, match="runs as root"):
            check_environment(settings)
    else:
        assert check_environment(settings).startswith("production: not root")
