"""Hermes Agent (hermes-agent 0.19.0) on Flywheel's online loop: `chat.py`, a terminal chat front end run
with the python of hermes-agent's own venv, that sends the user's feedback to `POST /rl/v1/feedback`;
`online.example.yaml` and `eval.example.jsonl`, a config and eval set for `flywheel up --online`. See
README.md here."""
