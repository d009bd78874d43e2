"""Helpers shared by several test modules (fixtures live in tests/conftest.py)."""
