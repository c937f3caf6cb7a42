"""Run the Alembic migrations programmatically (used by the CLI, the demo and the tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

HERE = Path(__file__).resolve().parent


def sqlalchemy_url(database_url: str) -> str:
    """SQLAlchemy needs the psycopg 3 dialect named explicitly."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if database_url.startswith(prefix):
            return "postgresql+psycopg://" + database_url[len(prefix):]
    raise ValueError(f"not a Postgres URL: {database_url}")


def _config(database_url: str) -> Config:
    config = Config(str(HERE / "alembic.ini"))
    config.set_main_option("script_location", str(HERE / "migrations"))
    config.set_main_option("sqlalchemy.url", sqlalchemy_url(database_url).replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    """Step the schema back to ``revision``. Down to 0002 the ledger's rows are kept: the chains,
    actions and idempotency records survive, while 0008's delivery counts and 0006's sealed messages
    (which a migration holds no key to re-seal) are dropped. Below 0002 the recovery columns go."""
    command.downgrade(_config(database_url), revision)


def current(database_url: str) -> str | None:
    """The revision the database is at (``None`` before the first migration)."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    engine = create_engine(sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
