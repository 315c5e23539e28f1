"""DualPath services: one sub-package per process; thin wiring over ``dualpath``."""
