"""Reward hooks: graders that label finished sessions off the request path (contract.py says what a hook
is; registry.py names the built-in ones and resolves a user's `module:function`)."""
