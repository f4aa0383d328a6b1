"""Synthesis: LM backends, text that streams in, token->wave scheduling and the pipeline of one request."""
