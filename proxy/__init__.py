"""OpenAI-compatible proxy: OpenAI API, RL control API, auth, router, token-exact recorder."""
