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


def upgrade(database_url: str, revision: str = "head") -> None:
    config = Config(str(HERE / "alembic.ini"))
    config.set_main_option("script_location", str(HERE / "migrations"))
    config.set_main_option("sqlalchemy.url", sqlalchemy_url(database_url).replace("%", "%%"))
    command.upgrade(config, revision)
