"""FastAPI: the Gradio studio mounted at "/", /health, /metrics and the OpenAI-style /v1 API."""
