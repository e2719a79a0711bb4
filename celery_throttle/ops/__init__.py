"""Operating the limits: the ``celery throttle`` command."""
