"""The waiting room: tasks parked in Redis until their booked start, and the dispatcher that sends
them on to their queue."""
