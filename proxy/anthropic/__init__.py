"""Anthropic's Messages API on the call pipeline: the request body (`schemas.py`), its translation into a
chat request (`translate.py`), the `message` object (`output.py`), named stream events (`stream.py`), what a
recorded call adds to the conversation tree (`record.py`), the API and `count_tokens` (`api.py`), and the
routes with Anthropic-shaped errors (`routes.py`)."""
