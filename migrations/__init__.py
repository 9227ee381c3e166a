"""Alembic migrations for the storage schema; run them with `flywheel db upgrade` (storage.migrate)."""
