"""The Celery side: settings, each process's runtime, ``@throttled``, admission and deferral,
leases of running tasks, and ``install(app)``, which connects the worker's receivers."""
