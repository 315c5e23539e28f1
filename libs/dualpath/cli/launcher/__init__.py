"""launcher: ``dualpath up`` — embedded NATS plus every service as a local process, for a topology."""
