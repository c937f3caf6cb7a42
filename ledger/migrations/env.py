"""Alembic environment: migrates the database named by ``sqlalchemy.url`` in the config."""

from alembic import context
from sqlalchemy import create_engine, pool

from ledger.schema import metadata

config = context.config


def run_migrations_online() -> None:
    engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations_online()
