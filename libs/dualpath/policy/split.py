"""Split reads (``ReadPath.SPLIT``, beyond the paper): one request's hit blocks read by both sides.

Whole-request read sides cannot balance the storage NICs when few, long requests are in
flight: a 64K-token context keeps one node's storage NIC busy while the other idles. A
split read gives the PE node the *first* ``b`` hit blocks and the DE node the rest, so each
side reads one contiguous range (the strided layer transfers stay two simple runs) and the
two reads end as close together as whole blocks allow.

The rule, in tokens (the unit of ``read_q``): with ``q_pe``, ``q_de`` the two nodes' read
queues, ``H`` hit blocks of ``bt`` tokens and ``hop`` the extra cost of a DE-read token in
percent (the DE share crosses the decode GPU's compute NIC to the prefill engine layer by
layer, a hop the PE share does not make as a *read*), pick ``b`` in ``[0, H]`` minimising

    max(100·(q_pe + b·bt),  100·q_de + (100 + hop)·(H − b)·bt)

— the later of the two finish times, scaled by 100 so the comparison is exact in integers.
Ties go to the larger PE share (the classic path). ``b = H`` is a plain PE read, ``b = 0`` a
plain DE read: an idle PE node and a long DE queue degenerate to the whole-request rule.

Only a request longer than either queue, with no other request waiting behind it, is split
(``worth_splitting``): when many requests are in flight the whole-request rule balances the
NICs already, while a split request would wait for the later of two queues and hold a read
open on both nodes. The queues alone do not say how many are in flight: read admission keeps
them short and holds the rest in the scheduler's queue, so the queue condition alone splits
too often. Split reads are for the few-requests regime (docs/results.md, "Split reads", has
the runs behind both conditions).
"""

from __future__ import annotations

__all__ = ["DE_HOP_PERCENT", "split_blocks", "worth_splitting"]

DE_HOP_PERCENT = 10  # a DE-read token costs 10% more than a PE-read one (the CNIC hop to the PE)


def worth_splitting(hit_tokens: int, q_pe: int, q_de: int, behind: int = 0) -> bool:
    """Split only a request longer than what either queue already holds, with no request
    waiting behind it (``behind``: those in the scheduler's queue after it): few requests in
    flight. Otherwise the whole-request rule balances the NICs over many requests already,
    and a split request would wait for the later of two queues."""
    return 0 < hit_tokens and behind == 0 and max(q_pe, q_de) < hit_tokens


def _finish(q_pe: int, q_de: int, blocks: int, pe_blocks: int, bt: int, hop: int) -> int:
    """The later of both sides' finish times (scaled by 100) for ``pe_blocks`` on the PE side."""
    return max(100 * (q_pe + pe_blocks * bt), 100 * q_de + (100 + hop) * (blocks - pe_blocks) * bt)


def split_blocks(hit_blocks: int, block_tokens: int, q_pe: int, q_de: int, hop_percent: int = DE_HOP_PERCENT) -> int:
    """Blocks the PE node reads (the first ones); the DE node reads the other ``hit_blocks - b``.

    Raises:
        ValueError: on a negative count or queue, or a ``block_tokens`` below 1.
    """
    if hit_blocks < 0 or q_pe < 0 or q_de < 0 or hop_percent < 0 or block_tokens < 1:
        raise ValueError(
            f"split_blocks: bad input hit_blocks={hit_blocks} block_tokens={block_tokens} q_pe={q_pe} q_de={q_de} hop_percent={hop_percent}"
        )
    if hit_blocks == 0:
        return 0
    bt = block_tokens
    # The continuous optimum equalises both finish times; the best whole block is next to it.
    num = 100 * q_de + (100 + hop_percent) * hit_blocks * bt - 100 * q_pe
    den = (200 + hop_percent) * bt
    lo = min(max(num // den, 0), hit_blocks)
    best, best_t = lo, _finish(q_pe, q_de, hit_blocks, lo, bt, hop_percent)
    for b in (lo + 1,):
        if b <= hit_blocks:
            t = _finish(q_pe, q_de, hit_blocks, b, bt, hop_percent)
            if t <= best_t:  # ties: the larger PE share
                best, best_t = b, t
    return best
