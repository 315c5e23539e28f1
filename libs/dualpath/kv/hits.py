"""How many of a prompt's persisted blocks a prefill reads, and how many tokens it computes.

Two rules, here once for the gateway, the scheduler core, the prefill engine, the simulator
and the scheduler bench:

- **The last prompt token is always computed**: its logits give the first output token, so a
  hit block that would hold it is not read (``readable_hit_blocks``). Only whole blocks are
  read; what a prefill computes is the rest of the prompt (``miss_tokens``).
- **The planned hit blocks** are those readable ones when the scheduler chose a side to read
  them on, and none when it did not (``planned_hit_blocks``).
"""

from __future__ import annotations

__all__ = ["miss_tokens", "planned_hit_blocks", "readable_hit_blocks"]


def readable_hit_blocks(prompt_tokens: int, hit_blocks: int, block_tokens: int) -> int:
    """The leading blocks of a ``prompt_tokens``-token prompt read from storage when its first
    ``hit_blocks`` blocks are persisted: all of them but any that holds the last prompt token
    (always computed); never negative.

    >>> readable_hit_blocks(300, 2, 64), readable_hit_blocks(128, 2, 64), readable_hit_blocks(129, 2, 64)
    (2, 1, 2)
    """
    return max(0, min(hit_blocks, (prompt_tokens - 1) // block_tokens))


def miss_tokens(prompt_tokens: int, hit_blocks: int, block_tokens: int) -> int:
    """Prompt tokens a prefill computes when ``hit_blocks`` leading blocks are persisted: the
    prompt less its readable hits (what the scheduler charges the prefill engine)."""
    return prompt_tokens - readable_hit_blocks(prompt_tokens, hit_blocks, block_tokens) * block_tokens


def planned_hit_blocks(prompt_tokens: int, hit_blocks: int, block_tokens: int, *, reads: bool) -> int:
    """The blocks a placement plans to read: the readable hits when it ``reads`` (the scheduler
    chose a read side: a prefill task's read path is PE or DE), none when it does not."""
    return readable_hit_blocks(prompt_tokens, hit_blocks, block_tokens) if reads else 0
