"""Shared test helpers: run folders, reference models, a served model, the reference data."""
