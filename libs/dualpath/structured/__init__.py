"""Structured outputs: llguidance grammars built by the gateway (``grammar``) and applied by the
engines as a per-request token mask (``constraint``, through ``dualpath.model.sampling``)."""
