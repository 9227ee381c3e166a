"""One file per schema change, applied in order by Alembic."""
