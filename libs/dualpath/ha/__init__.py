"""High availability: local NATS clusters, the scheduler's leadership lease, the replicated block index."""
