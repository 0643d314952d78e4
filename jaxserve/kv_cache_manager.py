"""Host bookkeeping of the paged KV pool: which request owns which pages, in order.

The device pool (`kv_pages.KVPages`) is one preallocated array; this class only hands out page
numbers 0..num_pages-1 from a free list and records each request's page table, so admission and
preemption are list operations that cost microseconds. Plain Python, no jax.
"""

from __future__ import annotations


class KVCacheManager:
    """Page tables of live requests over a fixed pool of `num_pages` pages of `page_size` slots."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int):
        if num_pages < 1 or page_size < 1 or max_pages_per_seq < 1:
            raise ValueError(
                f"The KV pool needs {num_pages=}, {page_size=} and {max_pages_per_seq=} all >= 1."
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        # A stack popped from the end: low page numbers go first, and freed pages are reused first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def usage(self) -> float:
        """Share of the pool in use, for the KV-cache-use metric."""
        return self.num_used_pages / self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` cache slots."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def num_pages_of(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's table to cover `num_tokens` slots; all or nothing.

        Returns False, changing nothing, when the free list is too short: the caller then
        preempts or waits. More pages than one sequence may hold is a caller bug (admission
        refuses such requests), so it raises.
        """
        table = self._tables.get(request_id, [])
        want = self.pages_for(num_tokens)
        if want > self.max_pages_per_seq:
            raise ValueError(
                f"Request {request_id!r} needs {want} pages for {num_tokens} tokens, more than "
                f"{self.max_pages_per_seq=}."
            )
        need = want - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            table.append(self._free.pop())
        self._tables[request_id] = table
        return True

    def page_table(self, request_id: str) -> list[int]:
        """A copy of the request's pages in order (empty when it holds none)."""
        return list(self._tables.get(request_id, ()))

    def free(self, request_id: str) -> int:
        """Returns all the request's pages to the pool; returns how many (0 if it held none)."""
        table = self._tables.pop(request_id, [])
        # Reversed so the next allocation pops them back in the same order.
        self._free.extend(reversed(table))
        return len(table)

    def check_invariants(self) -> None:
        """Raises AssertionError unless every page is either free or owned, exactly once."""
        owned = [p for table in self._tables.values() for p in table]
        every = owned + self._free
        if len(every) != self.num_pages or set(every) != set(range(self.num_pages)):
            raise AssertionError(
                f"KV pages leaked or doubled: {len(self._free)} free + {len(owned)} owned "
                f"!= {self.num_pages} pages, or a page is listed twice."
            )
        for request_id, table in self._tables.items():
            if not table or len(table) > self.max_pages_per_seq:
                raise AssertionError(f"Request {request_id!r} holds {len(table)} pages.")
