"""The request seam: one service per process that prepares, admits and speaks requests, with saved voices,
ASR and metrics. It sits between the doors (the server and the page) and synthesis (app/engine)."""
