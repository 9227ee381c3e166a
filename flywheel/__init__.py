"""Flywheel CLI, root config and process launcher."""
