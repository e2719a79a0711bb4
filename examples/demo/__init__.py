"""The demo: 200 LLM calls through @throttled, then through Celery's rate_limit (`make demo`)."""
