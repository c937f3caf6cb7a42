"""Egress allowlists (worker/sandbox_egress.py): what the servers file may say, how each entry maps
onto the sandbox's own loopback, and the bubblewrap and relay command lines built from it (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proofline.errors import ConfigurationError
from worker.sandbox import SandboxSpec, bwrap_args, launch, reader_sandbox
from worker.sandbox_egress import INSIDE_DIR, EgressPlan, EgressPolicy, hosts_text, parse_entry, routes
from worker.servers import check_sandbox_policy, load_servers

SERVERS = """
servers:
  api:
    transport: stdio
    command: ["{{python}}", "-m", "tool"]
    sandbox:
      audit: false
      network: {{allow: {allow}}}
    read_identity: {{}}
"""


def servers_file(tmp_path: Path, allow: str) -> Path:
    path = tmp_path / "servers.yaml"
    path.write_text(SERVERS.format(allow=allow))
    load_servers.cache_clear()
    return path


def test_entries_parse_to_loopback_addresses_and_host_names() -> None:
    assert parse_entry("127.0.0.1:8443").text == "127.0.0.1:8443"
    assert parse_entry("127.1.2.3:80").loopback
    assert parse_entry("[::1]:8443").text == "[::1]:8443"
    named = parse_entry("API.Example.com.:443")
    assert (named.host, named.port, named.loopback) == ("api.example.com", 443, False)


@pytest.mark.parametrize(("entry", "why"), [
    ("127.0.0.1", "a port is required"),
    ("127.0.0.1:0", "from 1 to 65535"),
    ("127.0.0.1:70000", "from 1 to 65535"),
    ("127.0.0.1:http", "from 1 to 65535"),
    ("10.0.0.5:5432", "must be a loopback one"),
    ("0.0.0.0:80", "must be a loopback one"),
    ("::1:80", "[ADDRESS]:PORT"),
    ("localhost:80", "write 127.0.0.1"),
    ("*.example.com:443", "neither a loopback address nor a host name"),
    ("https://api.example.com:443", "not a URL"),
    (8443, "expected a string"),
])
def test_a_malformed_entry_is_refused_naming_it(entry: object, why: str) -> None:
    with pytest.raises(ValueError, match="entry") as raised:
        parse_entry(entry)
    assert why in str(raised.value) and repr(entry) in str(raised.value)


@pytest.mark.parametrize(("allow", "why"), [
    ('["127.0.0.1:8443", "10.1.1.1:443"]', "entry '10.1.1.1:443': an IP address must be a loopback one"),
    ('["127.0.0.1:8443", "127.0.0.1:8443"]', "entry '127.0.0.1:8443': the same destination"),
    ("[]", "non-empty list"),
    ('"127.0.0.1:8443"', "non-empty list"),
])
def test_the_servers_file_refuses_a_bad_allowlist_naming_file_server_and_entry(tmp_path: Path, allow: str,
                                                                              why: str) -> None:
    path = servers_file(tmp_path, allow)
    # The worker's start check and doctor load the file through the same code.
    for load in (lambda: load_servers(path), lambda: check_sandbox_policy(path, "production")):
        with pytest.raises(ConfigurationError) as raised:
            load()
        detail = raised.value.detail
        assert str(path) in detail and "server api" in detail and why in detail, detail
        assert "sandbox.network" in detail and "pydantic" not in detail
    load_servers.cache_clear()


def test_network_takes_only_a_boolean_or_an_allowlist(tmp_path: Path) -> None:
    path = tmp_path / "servers.yaml"
    path.write_text(SERVERS.format(allow='["127.0.0.1:1"]').replace("network: {allow: [\"127.0.0.1:1\"]}",
                                                                      'network: "yes"'))
    load_servers.cache_clear()
    with pytest.raises(ConfigurationError, match="must be true, false or"):
        load_servers(path)
    with pytest.raises(ValueError, match="network.deny"):
        SandboxSpec(network={"allow": ["127.0.0.1:1"], "deny": []})
    load_servers.cache_clear()


def test_the_read_identity_inherits_the_allowlist(tmp_path: Path) -> None:
    server = load_servers(servers_file(tmp_path, '["127.0.0.1:8443"]'))["api"]
    assert server.read.sandbox.egress == server.write.sandbox.egress == EgressPolicy(allow=("127.0.0.1:8443",))
    assert SandboxSpec(**reader_sandbox({"network": {"allow": ["127.0.0.1:1"]}}, {"network": False})).egress is None
    load_servers.cache_clear()


def test_names_map_onto_free_loopback_addresses() -> None:
    policy = EgressPolicy(allow=("127.100.0.1:443", "api.example.com:443", "api.example.com:8443",
                                 "db.example.com:5432", "127.0.0.1:8443"))
    got = {r.destination.text: r.inside for r in routes(policy)}
    # 127.100.0.1:443 is taken by a literal entry: the first name moves on to the next address.
    assert got == {"127.100.0.1:443": "127.100.0.1:443", "api.example.com:443": "127.100.0.2:443",
                   "api.example.com:8443": "127.100.0.2:8443", "db.example.com:5432": "127.100.0.3:5432",
                   "127.0.0.1:8443": "127.0.0.1:8443"}
    hosts = hosts_text(routes(policy)).splitlines()
    assert "127.100.0.2 api.example.com" in hosts and "127.100.0.3 db.example.com" in hosts
    assert hosts.count("127.100.0.2 api.example.com") == 1


def plan(allow: tuple[str, ...]) -> EgressPlan:
    return EgressPlan(tuple(routes(EgressPolicy(allow=allow))), "/w/egress/sockets", "/w/egress/hosts",
                      "/w/egress/nsswitch.conf")


def test_the_launch_runs_the_server_behind_the_relay_in_its_own_network_namespace() -> None:
    spec = SandboxSpec(network={"allow": ["127.0.0.1:8443"]}, audit=False)
    roots: list = []
    got = launch(spec, command=["/venv/bin/python", "-m", "tool"], env={}, cwd="/srv", base_dir=Path("/srv"),
                 runtime_paths=["/venv"], egress=plan(("127.0.0.1:8443",)), roots=roots)
    argv = got.args
    assert "--unshare-net" in argv
    binds = [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == "--ro-bind"]
    assert ("/w/egress/sockets", INSIDE_DIR) in binds and ("/w/egress/hosts", "/etc/hosts") in binds
    assert ("/w/egress/nsswitch.conf", "/etc/nsswitch.conf") in binds
    assert ("/etc/resolv.conf", "/etc/resolv.conf") not in binds  # no resolver: names come from /etc/hosts
    inner = argv[argv.index("--", argv.index("--chdir")) + 1:]
    assert inner[1:3] == ["-I", "-S"] and inner[3].endswith("worker/egress_relay.py")
    assert inner[4:] == ["--route", f"127.0.0.1:8443={INSIDE_DIR}/0.sock", "--", "/venv/bin/python", "-m", "tool"]
    assert roots[0].allowed == ("127.0.0.1:8443",) and not roots[0].network


def test_an_allowlist_without_a_forwarder_has_no_network_at_all() -> None:
    """``describe_server`` spawns without a forwarder: nothing is bound, no relay runs."""
    spec = SandboxSpec(network={"allow": ["api.example.com:443"]})
    argv = bwrap_args(spec, command=["tool"], env={}, cwd="/srv", base_dir=Path("/srv"), runtime_paths=[])
    assert "--unshare-net" in argv and INSIDE_DIR not in argv and "/etc/hosts" not in argv
    got = launch(spec, command=["tool"], env={}, cwd="/srv", base_dir=Path("/srv"), runtime_paths=[])
    assert got.args[-1] == "tool" and "egress_relay" not in " ".join(got.args)


def test_ca_certificates_are_bound_only_for_named_hosts() -> None:
    exists = {"/etc/ssl"}.__contains__
    assert "/etc/ssl" not in plan(("127.0.0.1:1",)).bwrap_args(exists=exists)
    assert ["--ro-bind", "/etc/ssl", "/etc/ssl"] == plan(("api.example.com:443",)).bwrap_args(exists=exists)[-3:]


def _hx(text: str) -> str:
    return "".join(f"\\x{b:02x}" for b in text.encode())


def test_the_audit_excuses_the_allowed_addresses_only() -> None:
    """A non-blocking connect to an allowed address fails with EINPROGRESS (strace prints it, the
    audit must not count it); the same connect anywhere else is the attempt the allowlist forbids."""
    from worker.sandbox import Roots
    from worker.sandbox_audit import classify, parse

    allowed = Roots(allowed=tuple(r.inside for r in routes(EgressPolicy(allow=("127.0.0.1:8443", "[::1]:9000",
                                                                             "api.example.com:443")))))
    assert allowed.allowed == ("127.0.0.1:8443", "::1:9000", "127.100.0.1:443")

    def v4(port: int, address: str = "127.0.0.1") -> dict:
        return parse(f'7 connect(3<\\x73>, {{sa_family=AF_INET, sin_port=htons({port}), sin_addr=inet_addr("'
                     f'{_hx(address)}")}}, 16) = -1 EINPROGRESS (Operation now in progress)')

    v6 = parse('7 connect(3, {sa_family=AF_INET6, sin6_port=htons(9000), sin6_flowinfo=htonl(0), '
               f'inet_pton(AF_INET6, "{_hx("::1")}", &sin6_addr), sin6_scope_id=0}}, 28) = -1 EINPROGRESS (x)')
    assert classify(v4(8443), allowed) is None and classify(v6, allowed) is None
    assert classify(v4(443, "127.100.0.1"), allowed) is None
    assert classify(v4(8444), allowed)["address"] == "127.0.0.1:8444"
    assert classify(v4(443), allowed)["kind"] == "network_denied"  # the name's port, not on 127.0.0.1
    assert classify(v4(8443), Roots())["kind"] == "network_denied"  # no allowlist: nothing is excused
