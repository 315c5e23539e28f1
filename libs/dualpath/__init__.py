"""DualPath shared library: imported by the services, the testbed and the simulator.

Concepts live in their own sub-packages:

- ``protocol``  control-plane message types and NATS subjects (msgpack on the wire)
- ``bus``       NATS connection helpers and the embedded ``nats-server``
- ``kv``        block hashing, the Full Block file format, block storage, the trie index
- ``transfer``  the data plane: memory regions, transports (tcp, shm, verbs), NIC limiters
- ``model``     the torch decoder (Qwen2/Llama family) and the tiny-checkpoint maker
- ``policy``    the DualPath scheduling policy (pure: state in, decisions out)
- ``cost``      the roofline cost model of target models on target GPUs
- ``telemetry`` structured logs, traces and metrics
"""

__version__ = "0.1.0"

from dualpath.compiled import activate as _activate_compiled

_activate_compiled()  # the simulator's hot path as mypyc extensions, when built and fresh (dualpath/compiled.py)
