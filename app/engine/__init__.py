"""Concurrency and streaming around the model: LM backends, token-to-wave scheduling, pipeline."""
