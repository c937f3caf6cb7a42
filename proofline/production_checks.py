"""The production rules that need a look at the host and its services, not only at the settings:
the runtime roles' Postgres logins want a password, the broker wants credentials, and a process
can read no private key but its own role's. ``proofline/setup_checks.py`` runs them for ``doctor``
and before a worker consumes; each raises :class:`~proofline.setup_checks.Failed` in production
and only reports outside it.

How each is found out (docs/security/production.md says the same to operators):

- **trust**: each runtime role's URL is tried once with a random password it cannot know. A
  server that checks passwords refuses it (SQLSTATE ``28P01``, or ``28000`` for a ``reject`` or a
  missing ``pg_hba.conf`` line); one that lets it in checks nothing (``trust``, or ``peer``/``ident``
  on that line). Reading ``pg_hba_file_rules`` would say the same but needs a superuser, which a
  runtime role must not be. The one refused login it costs shows in Postgres's log.
- **a broker without credentials**: an unauthenticated ``PING`` to the configured Redis must be
  refused (``NOAUTH``); a RabbitMQ broker URL must not name ``guest``, and a ``guest/guest`` login
  to the configured host must be refused.
- **key files**: every private key file under the configured key folders (the keyring's folder,
  ``PROOFLINE_KEYS_DIR``, and the folders of the configured key files, one level down as
  ``proofline init`` lays them out) is tried with ``os.access`` as the user running the check. A
  key of another role it can read is refused, whatever the settings name; a key of its own role
  must have no group or other permission bits.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit

from proofline.keys import FILES, KEYRING_FILE, SEAL_FILE
from proofline.settings import Environment, Settings, reveal

#: The private keys a process of each role may read: its own, and the seal key every process uses.
MAY_READ = {"execute": {"worker", "seal"}, "recovery": {"recovery", "ledger", "seal"},
            "all": {"worker", "recovery", "ledger", "seal"}, "controller": {"controller", "seal"}}
#: Key roles by file name (``proofline keys generate``) and by folder name (``proofline init``).
ROLE_OF_NAME = {**{name: role for role, name in FILES.items()}, SEAL_FILE: "seal", "approver.key": "approver"}
KEY_FOLDERS = {*FILES, "seal", "approver"}
#: The runtime roles' database URLs, by the setting that holds each.
RUNTIME_URLS = ("database_url", "controller_database_url", "operator_database_url", "reader_database_url")
#: SQLSTATEs of a login the server refused: a wrong password, or no pg_hba.conf line letting it in.
REFUSED_LOGIN = {"28P01", "28000"}
CONNECT_TIMEOUT = 5


def _failed(detail: str, fix: str) -> Exception:
    from proofline.setup_checks import Failed

    return Failed(detail, fix)


def _where(url: str) -> str:
    """A URL's user, host, port and database, never its password."""
    parts = urlsplit(url)
    user = unquote(parts.username or "")
    return f"{user}@{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path}"


def accepts_any_password(url: str) -> bool | None:
    """Whether the server let ``url``'s role in with a password it cannot know (None: it could not
    be asked; the database check says why)."""
    import psycopg

    try:
        psycopg.connect(url, password=f"wrong-{secrets.token_urlsafe(18)}", connect_timeout=CONNECT_TIMEOUT).close()
    except psycopg.OperationalError as exc:
        text = str(exc)
        refused = getattr(exc, "sqlstate", None) in REFUSED_LOGIN or "password authentication failed" in text \
            or "pg_hba.conf" in text
        return False if refused else None
    except psycopg.Error:
        return None
    return True


def check_database_auth(settings: Settings, own: bool = False) -> str:
    """No runtime role logs in without a password: this process's own URL (``own``, a worker), or
    every runtime role's URL that is configured (doctor)."""
    names = ("database_url",) if own else RUNTIME_URLS
    urls = {name: reveal(getattr(settings, name)) for name in names if getattr(settings, name) is not None}
    if settings.environment != Environment.production:
        return f"{settings.environment.value}: not checked (production only)"
    trusted, unasked = [], []
    for name, url in urls.items():
        answer = accepts_any_password(url or "")
        if answer:
            trusted.append(f"PROOFLINE_{name.upper()} ({_where(url or '')})")
        elif answer is None:
            unasked.append(f"PROOFLINE_{name.upper()}")
    if trusted:
        raise _failed(f"Postgres let {', '.join(trusted)} in with a wrong password (trust authentication): anyone who "
                      "reaches the server can act as that role",
                      "give each runtime role a password (ALTER ROLE ... PASSWORD), put it in its URL, and turn its "
                      "pg_hba.conf line from trust to scram-sha-256 (then SELECT pg_reload_conf())")
    asked = [n for n in urls if f"PROOFLINE_{n.upper()}" not in unasked]
    note = f"; could not ask for {', '.join(unasked)} (the database check says why)" if unasked else ""
    return f"a wrong password is refused for {len(asked)} role URL(s){note}"


def _redis_answers_unauthenticated(host: str, port: int, tls: bool) -> bool | None:
    import redis

    client = redis.Redis(host=host, port=port, ssl=tls, socket_connect_timeout=CONNECT_TIMEOUT,
                         socket_timeout=CONNECT_TIMEOUT)
    try:
        return bool(client.ping())
    except redis.AuthenticationError:
        return False
    except redis.ResponseError as exc:
        return False if "NOAUTH" in str(exc) or "auth" in str(exc).lower() else None
    except redis.RedisError:
        return None
    finally:
        client.close()


def _guest_logs_in(host: str, port: int, vhost: str) -> bool | None:
    from kombu import Connection

    try:
        with Connection(hostname=host, port=port, userid="guest", password="guest", virtual_host=vhost or "/",
                        transport="pyamqp", connect_timeout=CONNECT_TIMEOUT) as conn:
            conn.ensure_connection(max_retries=0, timeout=CONNECT_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - a refused login and an unreachable host both end here
        text = f"{type(exc).__name__} {exc}"
        return False if "ACCESS_REFUSED" in text or "AccessRefused" in text or "403" in text else None
    return True


def _rabbitmq_auth(url: SplitResult) -> str:
    """One RabbitMQ node: not reached as guest, and refusing a guest/guest login."""
    host = url.hostname or "127.0.0.1"
    port = url.port or (5671 if url.scheme == "amqps" else 5672)
    fix = "make a RabbitMQ user of your own with a password for Proofline and delete guest " \
          "(rabbitmqctl delete_user guest)"
    if unquote(url.username or "") == "guest":
        raise _failed(f"PROOFLINE_BROKER_URL logs in to {host}:{port} as RabbitMQ's default guest account", fix)
    if url.scheme != "amqps" and _guest_logs_in(host, port, unquote(url.path[1:]) if url.path else "/"):
        raise _failed(f"the RabbitMQ at {host}:{port} accepts the default guest/guest login", fix)
    return f"the RabbitMQ at {host}:{port}: not reached as guest, guest/guest refused"


def check_broker_auth(settings: Settings) -> str:
    """The broker asks for credentials: Redis refuses an unauthenticated PING; RabbitMQ is not
    reached as ``guest`` and refuses a ``guest/guest`` login."""
    url = urlsplit(reveal(settings.broker_url) or "")
    if settings.environment != Environment.production:
        return f"{settings.environment.value}: not checked (production only)"
    host = url.hostname or "127.0.0.1"
    if url.scheme in ("redis", "rediss"):
        port = url.port or 6379
        answer = _redis_answers_unauthenticated(host, port, url.scheme == "rediss")
        if answer:
            raise _failed(f"the Redis at {host}:{port} answers PING without a password: anyone who reaches it can "
                          "read and send the workers' tasks",
                          "set requirepass (or ACL users with passwords) in redis.conf and put the password in "
                          "PROOFLINE_BROKER_URL (redis://:PASSWORD@HOST:6379/0)")
        return f"the Redis at {host}:{port} " + ("refuses an unauthenticated PING" if answer is False else
                                                 "could not be reached to check (the broker check says why)")
    if url.scheme in ("amqp", "amqps", "pyamqp"):
        # A cluster's URL is a ``;``-separated list of its nodes: each one is checked.
        nodes = [urlsplit(part.strip()) for part in (reveal(settings.broker_url) or "").split(";") if part.strip()]
        return "; ".join(_rabbitmq_auth(node) for node in nodes)
    return f"a {url.scheme or 'default'} broker: its credentials are the database's (see the trust check)"


# --- key files ------------------------------------------------------------------------------------


def _key_roots(settings: Settings) -> set[Path]:
    """The folders private keys live in: the keys folder, the keyring's folder, and every configured
    key file's folder (or the one above it, when it is a ``proofline init`` role folder)."""
    roots: set[Path] = set()
    if settings.keys_dir is not None:
        roots.add(Path(settings.keys_dir))
    if settings.keyring_file is not None:
        roots.add(Path(settings.keyring_file).parent)
    for path in _configured_keys(settings).values():
        folder = path.parent
        roots.add(folder.parent if folder.name in KEY_FOLDERS else folder)
    return {r.resolve() for r in roots if r.is_dir()}


def _configured_keys(settings: Settings) -> dict[str, Path]:
    named = {"controller": settings.signing_key_file, "recovery": settings.recovery_key_file,
             "worker": settings.worker_key_file, "ledger": settings.ledger_key_file, "seal": settings.seal_key_file}
    return {role: Path(path) for role, path in named.items() if path is not None}


def _role_of(path: Path) -> str | None:
    """A readable key file's role: its own ``role`` field, else its folder's or its file's name."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        document = None
    if isinstance(document, dict) and isinstance(document.get("role"), str):
        return str(document["role"])
    if path.parent.name in KEY_FOLDERS:
        return path.parent.name
    return ROLE_OF_NAME.get(path.name)


def key_files(settings: Settings) -> list[Path]:
    """Every candidate private key file: ``*.key`` in a key folder, and every file in its role folders."""
    found: set[Path] = set(_configured_keys(settings).values())
    for root in _key_roots(settings):
        try:
            entries = list(root.iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir():
                    found.update(p for p in entry.iterdir() if p.is_file() and p.name != KEYRING_FILE)
                elif entry.suffix == ".key":
                    found.add(entry)
            except OSError:  # a folder this user may not open holds nothing this user can read
                continue
    return sorted(p for p in found if p.is_file())


def key_file_problems(settings: Settings, role: str) -> list[str]:
    """What a process of ``role`` can read that it must not, and its own keys that others may read."""
    allowed = MAY_READ[role]
    problems = []
    for path in key_files(settings):
        if not os.access(path, os.R_OK):
            continue
        owner = _role_of(path)
        if owner is None:
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        if owner not in allowed:
            problems.append(f"can read the {owner} key {path} (mode {mode:04o}, owner uid {path.stat().st_uid})")
        elif mode & 0o077:
            problems.append(f"its own {owner} key {path} is open to group or others (mode {mode:04o})")
    return problems


def check_key_files(settings: Settings, role: str) -> str:
    """A process reads only its own role's private keys, by permission: ``os.access`` as this user."""
    problems = key_file_problems(settings, role)
    user = f"uid {os.geteuid()}"
    if problems and settings.environment == Environment.production:
        article = "an" if role[0] in "aeiou" else "a"
        raise _failed(f"{article} {role} process ({user}) {problems[0]}" + (f" (and {len(problems) - 1} more)"
                                                                    if len(problems) > 1 else ""),
                      "run each role as its own system user and give it only its own key folder: chown -R USER "
                      "keys/ROLE, chmod 700 keys/ROLE, chmod 600 keys/ROLE/* (the layout `proofline init` writes)")
    if problems:
        return f"{settings.environment.value}: would be refused in production: {'; '.join(problems)[:300]}"
    return f"{user} reads no other role's key and its own are 0600 ({len(key_files(settings))} key file(s) looked at)"

