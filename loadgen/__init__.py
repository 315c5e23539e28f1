"""Load generator for multi-turn agentic workloads (offline rollouts and online SLO runs)."""
