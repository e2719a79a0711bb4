"""A queue-level limit (throttle_queues) on undecorated tasks."""
