"""OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of AsyncEngine."""
