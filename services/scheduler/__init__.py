"""scheduler: cluster state from reports, the DualPath policy, queues, dispatch and re-dispatch."""
