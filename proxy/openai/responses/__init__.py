"""OpenAI's Responses API on the call pipeline: input items to chat messages (`input.py`), output items and
the `response` object (`output.py`), named stream events (`stream.py`), what a recorded call adds to the
conversation tree (`record.py`), and the API itself with `GET /v1/responses/{id}` (`api.py`)."""
