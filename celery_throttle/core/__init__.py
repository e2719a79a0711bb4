"""The Celery-free core: rates, limit records, keys, connections, the gates and the waiting
helpers, and the Lua they run.  Needs only redis-py: a web app imports it without Celery."""
