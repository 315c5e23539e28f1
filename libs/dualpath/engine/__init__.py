"""Engine internals shared by the prefill and decode services (no I/O of their own).

- ``layout``  where a request's KV lives in a node buffer slot (Full Blocks, Layer Block views)
- ``prefill`` layer-wise prefill of a batch with KV brought in per layer from outside
- ``decode``  the decode engine's KV memory and continuous-batching decode step
"""
