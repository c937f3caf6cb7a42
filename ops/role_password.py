"""Give a login role its password, read from a file (docker-compose: a secret), after migrations.

Migrations create roles without passwords; with SCRAM authentication a role cannot log in until a
password is set. The server stores it as a SCRAM verifier (``password_encryption``); it is never
in an argument list, an environment variable or a log line here.

    python -m ops.role_password proofline_runtime /run/secrets/runtime_db_password
"""

from __future__ import annotations

import sys
from pathlib import Path

import psycopg
from psycopg import sql

from proofline.settings import get_settings, reveal


def set_password(admin_url: str, role: str, password: str) -> None:
    if not password:
        raise SystemExit(f"empty password for {role}")
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute("SET password_encryption = 'scram-sha-256'")
        conn.execute(sql.SQL("ALTER ROLE {} WITH LOGIN PASSWORD {}").format(sql.Identifier(role), sql.Literal(password)))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    role, path = argv
    settings = get_settings()
    set_password(reveal(settings.admin_database_url) or reveal(settings.database_url), role, Path(path).read_text().strip())
    print(f"password set for role {role}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
