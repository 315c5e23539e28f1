"""prefill-engine: one per GPU; layer-wise prefill with KV brought in per layer, handoff to decode."""
