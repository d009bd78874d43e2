"""Helpers (and torchrun scripts, if any) of the FSDP worker tests."""
