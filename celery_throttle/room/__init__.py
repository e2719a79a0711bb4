"""The waiting room: tasks parked in Redis until their slot, and the dispatcher that sends
them on to their queue."""
