"""Alembic migrations of the rlproxy schema (a package so that they ship with the wheel)."""
