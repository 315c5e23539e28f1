"""gateway: the OpenAI-compatible HTTP front door (tokenize, look up hits, submit, stream)."""
