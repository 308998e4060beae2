"""Experiment scaffolding outside the installed package (run from the repository root)."""
