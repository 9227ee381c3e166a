"""Example agents and framework integrations: plain programs using base_url + api_key + REST."""
