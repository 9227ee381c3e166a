"""The RL control API: `/rl/v1` sessions, groups, rewards, ends and the policy version (`routes.py`), its
bodies (`schemas.py`) and operations (`operations.py`), with AReaL's `/rl` aliases.

May import the proxy's services and everything below them, never `proxy.openai`."""
