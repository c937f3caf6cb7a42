"""The bubblewrap command line built from a servers-file sandbox block (pure: no process started)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp.client.stdio import DEFAULT_INHERITED_ENV_VARS, StdioServerParameters

from proofline.errors import ConfigurationError
from proofline.settings import ROOT
from worker.connect import endpoint_target
from worker.sandbox import (
    SandboxSpec,
    bwrap_args,
    bwrap_binary,
    launch,
    launcher_environment,
    read_status,
    reader_sandbox,
    require_policy,
    violation,
)
from worker.servers import Endpoint, load_servers
from worker.stdio_launch import inherited_environment

HOST = {"/usr", "/bin", "/lib", "/lib64", "/etc/ld.so.cache", "/etc/resolv.conf", "/srv/tool", "/srv/data",
        "/srv/base/var"}
LINKS = {"/bin": "usr/bin", "/lib": "usr/lib"}


def args(spec: SandboxSpec, cwd: str = "/srv/base/var", env: dict[str, str] | None = None) -> list[str]:
    return bwrap_args(spec, command=["/venv/bin/python", "-m", "tool"], env=env or {"PATH": "/usr/bin", "K": "v"},
                      cwd=cwd, base_dir=Path("/srv/base"), runtime_paths=["/venv", "/usr", "/src/pkg"],
                      exists=lambda p: str(p) in HOST, is_symlink=lambda p: str(p) in LINKS,
                      readlink=lambda p: Path(LINKS[str(p)]))


def pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == flag]


def test_defaults_isolate_everything() -> None:
    argv = args(SandboxSpec(ro_paths=("/srv/tool",), rw_paths=("var",)))
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
                 "--die-with-parent", "--new-session", "--clearenv"):
        assert flag in argv
    assert argv[argv.index("--uid") + 1] == "65534" and argv[argv.index("--gid") + 1] == "65534"
    assert pairs(argv, "--setenv") == [("PATH", "/usr/bin"), ("K", "v")]
    assert ("--proc", "/proc") in zip(argv, argv[1:], strict=False)
    assert ("--tmpfs", "/tmp") in zip(argv, argv[1:], strict=False)
    ro = pairs(argv, "--ro-bind")
    assert ("/srv/tool", "/srv/tool") in ro and ("/venv", "/venv") in ro and ("/src/pkg", "/src/pkg") in ro
    assert ("/usr", "/usr") in ro and ro.count(("/usr", "/usr")) == 1  # the base prefix is under /usr already
    assert ("/etc/resolv.conf", "/etc/resolv.conf") not in ro  # no network, no resolver
    assert pairs(argv, "--bind") == [("/srv/base/var", "/srv/base/var")]  # relative to the servers file
    assert pairs(argv, "--symlink") == [("usr/bin", "/bin"), ("usr/lib", "/lib")]
    assert "--dir" not in argv  # the working directory is a declared path
    assert argv[argv.index("--chdir") + 1] == "/srv/base/var"
    assert argv[argv.index("--") + 1:] == ["/venv/bin/python", "-m", "tool"]


def test_network_and_an_undeclared_working_directory() -> None:
    argv = args(SandboxSpec(network=True), cwd="/srv/elsewhere")
    assert "--unshare-net" not in argv
    assert ("/etc/resolv.conf", "/etc/resolv.conf") in pairs(argv, "--ro-bind")
    # Not declared: an empty directory on the sandbox's own root, nothing of the host's.
    assert argv[argv.index("--dir") + 1] == "/srv/elsewhere"


def test_a_declared_path_that_does_not_exist_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="/srv/missing"):
        args(SandboxSpec(ro_paths=("/srv/missing",)))


def test_the_launcher_applies_hard_limits_and_a_status_file() -> None:
    spec = SandboxSpec(memory_mb=512, cpu_seconds=7, open_files=99, processes=12)
    out = launch(spec, command=["/bin/true"], env={}, cwd="/tmp", base_dir=Path("/"), status_path="/s.json",
                 runtime_paths=[])
    assert out.command == "/bin/sh" and out.args[0] == "-c"
    script = out.args[1]
    for limit in ("ulimit -v 524288", "ulimit -t 7", "ulimit -n 99", "ulimit -p 12"):
        assert limit in script
    assert 'exec 3>"$0"' in script and out.args[2] == "/s.json"
    assert out.args[3:6] == [bwrap_binary(), "--json-status-fd", "3"]
    assert out.env == launcher_environment()


def test_the_launcher_runs_the_bwrap_on_the_workers_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The launcher's own PATH is fixed (/usr/bin:/bin), so it is handed the bwrap this process
    finds: the one the start-up checks ran, not another one (or none) in /usr/bin."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    out = launch(SandboxSpec(), command=["/bin/true"], env={}, cwd="/tmp", base_dir=Path("/"), runtime_paths=[])
    assert out.args[3] == str(fake) and out.env["PATH"] == "/usr/bin:/bin"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert launch(SandboxSpec(), command=["/bin/true"], env={}, cwd="/tmp", base_dir=Path("/"),
                  runtime_paths=[]).args[3] == "bwrap"


def test_the_sdk_adds_nothing_of_the_workers_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Every variable the stdio client copies from the parent is pinned by the launcher environment.
    assert set(DEFAULT_INHERITED_ENV_VARS) <= set(launcher_environment())
    monkeypatch.setenv("HOME", "/root/secret-home")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "canary")
    endpoint = Endpoint(transport="stdio", command=("/bin/true",), env={"A": "b"})
    target = endpoint_target(endpoint, tmp_path)
    assert isinstance(target, StdioServerParameters) and target.command == "/bin/sh"
    from mcp.client.stdio import get_default_environment

    assert get_default_environment() | (target.env or {}) == launcher_environment()
    assert "canary" not in " ".join(target.args) and "/root/secret-home" not in " ".join(target.args)


def test_read_identity_gets_the_writers_paths_read_only() -> None:
    merged = reader_sandbox({"rw_paths": ["var"], "ro_paths": ["tools"], "cpu_seconds": 5}, {"uid": 65533})
    assert merged["rw_paths"] == [] and merged["ro_paths"] == ["tools", "var"] and merged["uid"] == 65533
    assert merged["cpu_seconds"] == 5


def test_the_repos_servers_file_sandboxes_sor_with_a_read_only_reader() -> None:
    load_servers.cache_clear()
    sor = load_servers(ROOT / "servers.yaml")["sor"]
    assert sor.write.sandbox.enabled and sor.write.sandbox.rw_paths == ("var",) and sor.write.cwd == "var"
    assert sor.read.sandbox.rw_paths == () and sor.read.sandbox.ro_paths == ("var",)
    assert sor.read.sandbox.uid == 65533 and not sor.read.sandbox.network


def test_production_rule() -> None:
    off = SandboxSpec(enabled=False)
    with pytest.raises(ConfigurationError, match="'tool'"):
        require_policy("tool", "write", off, "production")
    assert require_policy("tool", "write", off, "development") == "unsandboxed (development)"
    reasoned = SandboxSpec(enabled=False, reason="needs the host's GPU")
    assert require_policy("tool", "write", reasoned, "production") == "needs the host's GPU"
    assert require_policy("tool", "write", SandboxSpec(), "production") is None
    with pytest.raises(ValueError):
        SandboxSpec(uid=0)
    with pytest.raises(ValueError):
        SandboxSpec(enabled=False, reason="  ")


def test_exit_statuses(tmp_path: Path) -> None:
    assert violation(137) == {"exit_code": 137, "signal": 9, "signal_name": "SIGKILL"}
    assert violation(128 + 24)["signal_name"] == "SIGXCPU"
    assert violation(143) is None and violation(0) is None and violation(1) is None and violation(None) is None
    status = tmp_path / "status"
    status.write_text('{ "child-pid": 42, "net-namespace": 1 }\nnot json\n{ "exit-code": 137 }\n')
    assert read_status(status) == {"child-pid": 42, "net-namespace": 1, "exit-code": 137}
    assert read_status(tmp_path / "absent") == {}


def test_the_audit_block_asks_for_the_audit_and_says_what_an_overflow_does() -> None:
    from worker.sandbox import AuditPolicy, SandboxSpec, require_audit

    default = SandboxSpec().audit_policy
    assert not default.fails_closed("development") and default.fails_closed("production")
    strict = SandboxSpec(audit={"on_overflow": "fail_closed", "drain_seconds": 1})
    assert isinstance(strict.audit, AuditPolicy) and strict.audit_policy.fails_closed("development")
    assert strict.audit_policy.drain_seconds == 1
    assert not SandboxSpec(audit={"on_overflow": "record"}).audit_policy.fails_closed("production")
    # A block asks for the audit like ``true``: refused where strace is missing.
    assert require_audit("s", "write", strict, "production", available=True) is None
    with pytest.raises(ConfigurationError, match="strace is not installed"):
        require_audit("s", "write", strict, "development", available=False)
    with pytest.raises(ValueError):
        SandboxSpec(audit={"on_overflow": "ignore"})


@pytest.mark.parametrize("values", [{}, {"HOME": "/h", "PATH": "/bin", "TERM": "() { :; }", "USER": "u"},
                                    {"LOGNAME": "l", "SHELL": "/bin/sh", "OTHER": "x"}])
def test_the_session_host_inherits_what_the_sdk_would(monkeypatch: pytest.MonkeyPatch,
                                                      values: dict[str, str]) -> None:
    """The session host starts servers without the SDK (worker/stdio_launch.py): what a server
    inherits there must be what the SDK's stdio client gives one a pool process starts."""
    from mcp.client.stdio import get_default_environment

    for key in (*DEFAULT_INHERITED_ENV_VARS, "OTHER"):
        monkeypatch.delenv(key, raising=False)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    assert inherited_environment() == get_default_environment()
