"""Decision cores with no I/O and no clock of their own: the scheduler core and the engine cores (prefill and decode batchers)."""
