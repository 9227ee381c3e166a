"""The e2e tests reuse the database fixtures of the integration tests (SQLite file and Postgres)."""

from tests.integration.conftest import empty_db_url, postgres_server_url  # noqa: F401 - fixtures
