"""OpenAI's Responses API on the call pipeline: input items to chat messages (`input.py`), its tool kinds
as chat functions and their calls as output items (`tools.py`), output items and the `response` object
(`output.py`), named stream events (`stream.py`), what a recorded call adds to the conversation tree
(`record.py`), and the API itself with `GET /v1/responses/{id}` (`api.py`)."""
