"""Helpers shared by several test modules (fixtures live in tests/conftest.py and the conftest.py of
the folder whose modules share them)."""
