"""How many parallel tasks a kernel has, and how to cut its work into more for the cores.

A module of its own (no TVM schedule imports) so that both :mod:`.common` and
:mod:`.transpose_intrin` use it without importing each other.
"""

from __future__ import annotations

from tvm.target import Target


def num_cores(target: Target) -> int:
    """Return the target's ``num-cores`` attribute (1 when absent)."""
    cores = target.attrs.get("num-cores", 1)
    return max(1, int(cores))


def divisors(n: int) -> list[int]:
    """Return the divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def row_chunks(cores: int, column_tasks: int, row_tiles: int, min_tiles: int = 1) -> int:
    """Return how many parallel chunks to cut ``row_tiles`` into beside ``column_tasks``.

    A GEMM kernel's parallel tasks are its column blocks, each doing every row; a narrow output
    (a 64-channel conv, a 1024-column layer under AMX blocking) has fewer of them than cores.
    The answer is the fewest chunks, a divisor of ``row_tiles``, whose busiest core does at
    most a tenth more row tiles than the least possible (1 on one core): few chunks keep each
    task's weight columns in its cache across all its rows. A chunk keeps at least
    ``min_tiles`` row tiles (1 chunk when none can).
    """

    def busiest(chunks: int) -> int:
        return -(-column_tasks * chunks // cores) * (row_tiles // chunks)

    choices = [c for c in divisors(row_tiles) if c == 1 or row_tiles // c >= min_tiles]
    least = min(busiest(c) for c in choices)
    return min(c for c in choices if busiest(c) <= least * 1.1)
