"""traffic-manager: one per node; owns the node DRAM buffer, its storage I/O queue and data-plane endpoint."""
