"""The schema of the queue: batches, deliveries, breakers, hosts and heartbeats."""
