"""decode-engine: one per GPU; continuous-batching decode, token streaming, block persistence."""
