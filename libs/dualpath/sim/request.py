"""One turn of one agent as it crosses the simulated cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dualpath.policy import ReadSide
from dualpath.sim.agent import Agent

if TYPE_CHECKING:
    from dualpath.sim.decode import DecodeEngineSim
    from dualpath.sim.prefill import PrefillEngineSim
    from dualpath.sim.storage import NodeStorage

__all__ = ["SimRequest"]


class SimRequest:
    """A request (one agent turn), where the scheduler placed it, and the times it passed
    each stage (virtual seconds).

    ``buffer``: the prefill node whose DRAM buffer holds a slot of its hit KV on the PE read
    path, from the start of the storage read to the end of its prefill (on the DE read path
    the hits land in the request's slot in the decode node's buffer, reserved by the
    scheduler).
    """

    __slots__ = (
        "agent",
        "buffer",
        "de",
        "gen",
        "hit",
        "key",
        "kv_blocks",
        "loaded",
        "pe",
        "prompt",
        "read_side",
        "reads_left",
        "rid",
        "split_de",
        "t_batch",
        "t_first",
        "t_read",
        "t_submit",
        "ttst",
    )

    # set when the scheduler dispatches it (read before that: AttributeError)
    pe: PrefillEngineSim
    de: DecodeEngineSim

    def __init__(self, rid: int, agent: Agent, prompt: int, hit: int, gen: int, now: float) -> None:
        self.rid = rid
        self.key = str(rid)  # the cores' request id
        self.agent = agent
        self.prompt = prompt
        self.hit = hit
        self.gen = gen
        self.read_side: ReadSide | None = None  # None: nothing to read
        self.t_submit = now
        self.t_read = -1.0  # hit KV in a buffer
        self.t_batch = -1.0  # its first prefill batch started
        self.t_first = -1.0  # first token (end of its prefill)
        self.ttst = -1.0  # first -> second token
        self.loaded = False  # its hit KV went to the prefill engine (first chunk)
        self.buffer: NodeStorage | None = None
        self.kv_blocks = 0  # blocks whose KV the decode completed (its last filled block + 1; 0: none)
        self.split_de = 0  # split read (read_path split): the last hit tokens, read by the decode node
        self.reads_left = 0  # storage reads still running (2 for a split read)
