"""The emulated testbed: a hardware profile with a scale factor, and modeled compute.

The real services run unchanged; engines swap the torch decoder for ``ModeledDecoder`` (no
math, the cost model's time), and every storage and data-plane byte goes through emulated
NICs of the profile's bandwidth divided by the scale factor, with KV bytes per token divided
by the same factor, so transfer times are the cluster's while a laptop moves the bytes.
"""

from dualpath.testbed.modeled import HostPerStep, ModeledDecoder, fit_host_per_step
from dualpath.testbed.profile import HardwareProfile, scaled_bytes_per_token_layer

__all__ = ["HardwareProfile", "HostPerStep", "ModeledDecoder", "fit_host_per_step", "scaled_bytes_per_token_layer"]
