"""Reward hooks, verifiers, webhooks, judges and the session finalizer."""
