"""``proofline init``: the deployment folder it writes, read back by the same loaders the processes use.

File modes (each private key 0600 in a 0700 folder of its own, the keyring readable, the env files
private), the refusal to write into a non-empty folder, ``--force``, and that what it wrote is what
a production process accepts: the signed policy verifies against the keyring, the contract loads and
is pinned, the servers file passes the sandbox rule, and an execute worker given the shared .env
holds no signing key.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from proofline.auditor_keys import load_public, read_private
from proofline.authority import AuthorityMode, load_policy
from proofline.cli import main
from proofline.contracts import load_contract
from proofline.errors import InitFolderNotEmpty, NotADeploymentFolder
from proofline.keys import KeyRole, check_process_keys, load_keyring, load_signing_key
from proofline.pins import pinned_tool, read_pins
from proofline.scaffold import TEMPLATE_ACTION_TYPE, UNITS, Layout, init
from proofline.settings import Settings
from proofline_kit.devstack import read_env_file
from worker.servers import check_sandbox_policy, load_servers

ROLES = ("controller", "recovery", "ledger", "seal", "worker", "auditor", "approver")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Layout:
    return init(tmp_path_factory.mktemp("init") / "deploy", approver="alice@example.com")


def test_each_private_key_is_0600_in_a_0700_folder_of_its_own_and_the_keyring_is_readable(folder: Layout) -> None:
    folders = set()
    for role in ROLES:
        key = folder.key_file(role)
        assert mode(key) == 0o600, (role, oct(mode(key)))
        assert mode(key.parent) == 0o700, (role, oct(mode(key.parent)))
        assert [p.name for p in key.parent.iterdir()] == [key.name], role  # nothing else shares its folder
        folders.add(key.parent)
    assert len(folders) == len(ROLES)
    assert mode(folder.keys) == 0o755 and mode(folder.keyring) == 0o644
    assert sorted(p.name for p in folder.keys.iterdir() if p.is_file()) == ["auditor.pub", "keyring.json"]
    assert mode(folder.auditor_public) == 0o644
    for name in (".env", "recovery.env", "controller.env", "auditor.env"):
        assert mode(folder.root / name) == 0o600, name
    assert mode(folder.var) == 0o700


def test_the_keys_are_production_keys_the_keyring_lists_and_the_approver_is_named(folder: Layout) -> None:
    ring = load_keyring(folder.keyring, "production")
    for role in ("controller", "recovery", "ledger", "approver"):
        key = load_signing_key(folder.key_file(role), KeyRole(role), "production")
        entry = ring.get(key.key_id)
        assert entry is not None and entry.role == KeyRole(role) and not entry.development, role
    approver = load_signing_key(folder.key_file("approver"), KeyRole.approver, "production")
    assert ring.get(approver.key_id).identity == "alice@example.com"


def test_the_signed_policy_verifies_and_proposes_the_template_action_type(folder: Layout) -> None:
    signed = load_policy(folder.authority_json, load_keyring(folder.keyring, "production"), "production")
    assert signed is not None
    assert signed.policy.for_type(TEMPLATE_ACTION_TYPE).mode == AuthorityMode.propose
    assert yaml.safe_load(folder.authority_yaml.read_text())["action_types"][TEMPLATE_ACTION_TYPE]["mode"] == "propose"


def test_the_contract_template_loads_is_pinned_and_names_a_server_of_the_servers_file(folder: Layout) -> None:
    contract = load_contract(folder.contracts / f"{TEMPLATE_ACTION_TYPE}.yaml")
    assert contract.action_type == TEMPLATE_ACTION_TYPE
    version, digest = pinned_tool(read_pins(folder.contracts / "pins.json"), contract, folder.contracts / "pins.json")
    assert len(digest) == 64 and version == load_servers(folder.servers_file)[contract.server].expected_version
    # Every stdio identity is sandboxed: a production worker starts with this servers file.
    assert check_sandbox_policy(folder.servers_file, "production") == {}


def test_the_env_files_name_real_settings_and_keep_private_keys_to_their_process(folder: Layout) -> None:
    fields = {f"PROOFLINE_{name.upper()}" for name in Settings.model_fields}
    shared = read_env_file(folder.env_file)
    for name in (".env", "worker.env", "recovery.env", "controller.env", "auditor.env"):
        names = {k for k in read_env_file(folder.root / name) if k.startswith("PROOFLINE_")}
        assert names and names <= fields, (name, names - fields)
    assert not {"PROOFLINE_SIGNING_KEY_FILE", "PROOFLINE_RECOVERY_KEY_FILE", "PROOFLINE_LEDGER_KEY_FILE",
                "PROOFLINE_WORKER_KEY_FILE", "PROOFLINE_AUDITOR_KEY_FILE", "PROOFLINE_AUDITOR_DATABASE_URL"} & set(shared)
    assert read_env_file(folder.root / "controller.env")["PROOFLINE_SIGNING_KEY_FILE"] == str(folder.key_file("controller"))
    # An execute worker given the shared .env and worker.env starts in production: it holds its worker
    # key (which signs evidence only) and no key that signs envelopes or checkpoints.
    settings = Settings(**{k.removeprefix("PROOFLINE_").lower(): v for k, v in
                           {**shared, **read_env_file(folder.root / "worker.env")}.items() if k.startswith("PROOFLINE_")})
    assert settings.environment == "production"
    assert check_process_keys(settings, "execute") == []
    # It seals captured evidence to the auditor's public half, and is given nothing that opens it.
    assert load_public(settings).key_id == read_private(folder.key_file("auditor"), "production").key_id
    assert settings.auditor_key_file is None
    assert read_env_file(folder.root / "auditor.env")["PROOFLINE_AUDITOR_KEY_FILE"] == str(folder.key_file("auditor"))
    recovery = Settings(**{k.removeprefix("PROOFLINE_").lower(): v for k, v in
                           {**shared, **read_env_file(folder.root / "recovery.env")}.items() if k.startswith("PROOFLINE_")})
    assert check_process_keys(recovery, "recovery") == []


def test_systemd_units_and_compose_run_the_same_five_processes_on_the_same_env(folder: Layout) -> None:
    compose = yaml.safe_load((folder.root / "compose.yaml").read_text())
    assert sorted(compose["services"]) == sorted(UNITS)
    for unit in UNITS:
        text = (folder.root / "systemd" / f"proofline-{unit}.service").read_text()
        exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
        argv = exec_start.removeprefix("ExecStart=").split()
        assert argv[0] == str(folder.proofline)
        service = compose["services"][unit]
        assert service["command"] == ["proofline", *argv[1:]], unit
        assert f"EnvironmentFile={folder.env_file}" in text
        assert str(folder.env_file) in service["env_file"]
        mounted = {v.split(":")[0] for v in service["volumes"]}
        # Only the recovery process is given the recovery and ledger keys, only the execute worker its
        # worker key; no one the controller's.
        holds = {r for r in ROLES if str(folder.key_file(r).parent) in mounted}
        assert holds == {"recovery": {"seal", "recovery", "ledger"}, "worker": {"seal", "worker"}}.get(unit, {"seal"}), unit
        assert ("recovery.env" in text) == (unit == "recovery") and ("worker.env" in text) == (unit == "worker")


def test_a_non_empty_folder_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(InitFolderNotEmpty) as refused:
        init(target)
    assert refused.value.code == "init_folder_not_empty"
    assert [p.name for p in target.iterdir()] == ["notes.txt"]

    result = CliRunner().invoke(main, ["init", str(target)])
    assert result.exit_code == 3 and "init_folder_not_empty" in result.output
    assert [p.name for p in target.iterdir()] == ["notes.txt"]


def test_force_writes_over_a_folder_with_new_keys_and_leaves_other_files(tmp_path: Path) -> None:
    first = init(tmp_path / "d")
    old = json.loads(first.key_file("controller").read_text())["key_id"]
    (first.root / "notes.txt").write_text("keep me")
    with pytest.raises(InitFolderNotEmpty):
        init(first.root)
    again = init(first.root, force=True)
    new = json.loads(again.key_file("controller").read_text())["key_id"]
    assert new != old and (again.root / "notes.txt").read_text() == "keep me"
    assert mode(again.key_file("controller")) == 0o600 and mode(again.key_file("controller").parent) == 0o700
    # The policy is signed again with the new approver key, and verifies against the new keyring.
    assert load_policy(again.authority_json, load_keyring(again.keyring, "production"), "production") is not None


def test_init_prints_the_next_three_commands_and_dev_refuses_a_folder_init_did_not_make(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--json", "init", str(tmp_path / "new")])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert len(shown["next"]) == 3 and shown["next"][0].startswith("proofline dev --dir ")
    assert any(c.startswith("proofline approve ") for c in shown["next"])

    with pytest.raises(NotADeploymentFolder) as refused:
        Layout.at(tmp_path).require()
    assert refused.value.code == "dev_not_a_deployment_folder"
    ran = CliRunner().invoke(main, ["dev", "--dir", str(tmp_path)])
    assert ran.exit_code == 3 and "dev_not_a_deployment_folder" in ran.output
