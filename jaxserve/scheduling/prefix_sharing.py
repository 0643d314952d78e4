"""The scheduler's side of the prefix cache: match at admission, compute once, publish as computed.

With the prefix cache on (the default), admission first looks up the longest run of whole pages
whose tokens, and everything before them, a request already computed (kv_cache_manager): those
pages join the new request's table shared, its prefill starts after them, and the token budget
counts only what is left (always at least the last prompt token, whose logits are needed). As
steps complete, each request publishes its newly full pages; freed and preempted requests leave
theirs cached until a fresh page is needed, so a preempted request often resumes from its own.

A page is also computed only once while it is being computed: a waiting request whose next
uncached full page a running request is computing now waits for it and then takes it from the
cache (the n samples of one prompt, a burst of requests with one system prompt).

A prompt's last, partial page is forked rather than recomputed (copy on write,
kv_cache_manager): once a request has computed its prompt, its partial page is published; a
request admitted later whose tokens go on the same way after the same full pages (a beam's child,
whose prompt is its parent's plus one token; a sibling of the n samples) gets a copy of it and
computes only what follows. A sibling admitted while the first computes that page waits for it,
as for a full page.
"""

from __future__ import annotations

from jaxserve.scheduling.kv_cache_manager import KVCacheManager, PageHasher
from jaxserve.scheduling.request import Request, RequestStatus

# The fewest tokens a fork must spare: a page copy to save one token is not worth its dispatch,
# and one token (a BOS) is what unrelated prompts most often agree on.
MIN_FORK_TOKENS = 2


class PrefixSharing:
    """Hashes requests' full pages, matches them against the cache, and tracks who computes
    which page now, so that no page is computed twice at once."""

    def __init__(self, kv: KVCacheManager, page_size: int, model_key: str = "", fork: bool = True):
        self.kv = kv
        self.page_size = page_size
        self.hasher = PageHasher(page_size, model_key)
        self.fork = fork  # copy partial pages (the engine can copy pages on its device)
        # Prompts' partial pages that a running request computes now, by (parent hash, tokens),
        # and the key each request claimed: read-only outside this class.
        self.computing_tails: dict[tuple[bytes, tuple[int, ...]], Request] = {}
        self.tail_claims: dict[str, tuple[bytes, tuple[int, ...]]] = {}
        # Full pages that a running request will compute and publish, by hash: read-only
        # outside this class.
        self.computing: dict[bytes, Request] = {}
        # The (page index, hash) pairs each request claimed in `computing`, in page order, by
        # request id; an entry goes once all its pages are published.
        self.claims: dict[str, list[tuple[int, bytes]]] = {}

    def match(self, req: Request) -> list[int]:
        """Cached pages holding the longest prefix of `req`'s tokens.

        None for a request asking for prompt logprobs: a cached token's logits are never
        computed, and it needs every prompt token's.
        """
        if req.sampling_params.prompt_logprobs is not None:
            return []
        hashes = req.page_hashes
        start = len(hashes) * self.page_size
        if req.num_tokens - start >= self.page_size:
            self.hasher.extend(hashes, req.token_ids(start, req.num_tokens), req.cache_salt)
        return self.kv.match(hashes, req.num_tokens)

    def match_partial(self, req: Request, hit: list[int]) -> tuple[int, int] | None:
        """A published partial page to fork after `req`'s cached pages `hit`, and how many of
        `req`'s tokens it holds (always leaving the last to compute); None: no fork."""
        if not self.fork or req.sampling_params.prompt_logprobs is not None:
            return None
        start = len(hit) * self.page_size
        limit = min(req.num_tokens - 1 - start, self.page_size - 1)
        if limit < 1:
            return None
        parent = self._parent(req, len(hit))
        found = self.kv.match_partial(parent, req.token_ids(start, start + limit), limit)
        return found if found is not None and found[1] >= MIN_FORK_TOKENS else None

    def waits(self, req: Request, hit: list[int]) -> bool:
        """Whether another running request is computing `req`'s next uncached full page now.

        Then `req` waits until that request publishes the page, and takes it from the cache:
        its prompt is computed once, not once per request, at the price of starting a few steps
        later. Computing it twice at once would cost the same steps on a busy device anyway.
        Requests queued behind it are admitted around it meanwhile (admission.py): it waits for
        a page, not for room, so holding them back would stall unrelated requests for nothing.
        """
        hashes = req.page_hashes
        if len(hit) >= len(hashes):
            # Every full page is cached: it may wait for the partial page after them.
            key = self._tail_key(req)
            owner = None if key is None else self.computing_tails.get(key)
        else:
            owner = self.computing.get(hashes[len(hit)])
        return owner is not None and owner is not req and owner.status == RequestStatus.RUNNING

    def admitted(self, req: Request, num_hit: int, forked: bool = False) -> None:
        """Counts `req`'s lookup (`num_hit` pages served) and claims the full pages it computes
        from there on, those no one else computes already, and its prompt's partial page unless
        it `forked` one (published already: the siblings behind it fork it too, not wait)."""
        self.kv.record_query(req.num_tokens, num_hit * self.page_size)
        mine = [
            (i, h)
            for i, h in enumerate(req.page_hashes[num_hit:], num_hit)
            if self.computing.setdefault(h, req) is req
        ]
        if mine:
            self.claims[req.request_id] = mine
        key = None if forked else self._tail_key(req)
        if key is not None and self.computing_tails.setdefault(key, req) is req:
            self.tail_claims[req.request_id] = key

    def admitted_fork(self, num_tokens: int) -> None:
        """Counts `num_tokens` of an admitted request's prompt served by a forked partial page."""
        self.kv.record_query(0, num_tokens)  # queried already by `admitted`

    def publish_tail(self, req: Request, num_computed: int) -> None:
        """Publishes `req`'s partial page once its first `num_computed` tokens (its prompt, at
        its first sample) are computed, for later requests to fork, and ends its claim on it."""
        self._unclaim_tail(req)
        if not self.fork:
            return
        ps = self.page_size
        full = num_computed // ps
        if num_computed == full * ps:
            return
        hashes = req.page_hashes
        if len(hashes) < full:
            start = len(hashes) * ps
            self.hasher.extend(hashes, req.token_ids(start, full * ps), req.cache_salt)
        self.kv.publish_partial(
            req.request_id,
            full,
            self._parent(req, full),
            req.token_ids(full * ps, num_computed),
        )

    def _parent(self, req: Request, num_pages: int) -> bytes:
        """The hash a partial page after `req`'s first `num_pages` full pages is published
        under: the last of those pages' hash, or the root of `req`'s salt."""
        return req.page_hashes[num_pages - 1] if num_pages else self.hasher.root(req.cache_salt)

    def _tail_key(self, req: Request) -> tuple[bytes, tuple[int, ...]] | None:
        """What identifies `req`'s prompt's partial page, when forking it would spare another
        request with the same prompt MIN_FORK_TOKENS (all the page's tokens but the last, which
        that request computes); None otherwise: it would not fork, so nothing to wait for."""
        if not self.fork:
            return None
        ps, n = self.page_size, req.num_prompt_tokens
        full = n // ps
        if n - full * ps <= MIN_FORK_TOKENS or len(req.page_hashes) < full or req.output_token_ids:
            return None
        return self._parent(req, full), tuple(req.token_ids(full * ps, n))

    def release(self, req: Request) -> None:
        """Ends every claim of `req`, which stops running: those waiting for it compute the
        pages themselves."""
        self._unclaim(req, self.claims.pop(req.request_id, ()))
        self._unclaim_tail(req)

    def publish(self, req: Request) -> None:
        """Offers `req`'s newly computed full pages to the cache (cheap when none filled)."""
        ps = self.page_size
        # Pending tokens have no value to hash yet; their pages are published by a later update.
        full = min(req.num_computed_tokens, req.num_known_tokens) // ps
        hashes = req.page_hashes
        if full > len(hashes):
            start = len(hashes) * ps
            self.hasher.extend(hashes, req.token_ids(start, full * ps), req.cache_salt)
        self.kv.publish(req.request_id, hashes, full * ps, req.token_ids, req.lora_name)
        # Published now: others take them from the cache. Pages publish in order, so the claims
        # to end are the first ones; the rest of a long request's life costs nothing here.
        mine = self.claims.get(req.request_id)
        if mine:
            n = 0
            while n < len(mine) and mine[n][0] < full:
                n += 1
            self._unclaim(req, mine[:n])
            del mine[:n]
            if not mine:
                del self.claims[req.request_id]

    def check_invariants(self) -> None:
        """Raises AssertionError unless every page being computed has a running owner that
        claimed it."""
        for h, owner in self.computing.items():
            if owner.status != RequestStatus.RUNNING or h not in {
                claim for _, claim in self.claims.get(owner.request_id, ())
            }:
                raise AssertionError(
                    f"Request {owner.request_id!r} computes a page but is not running."
                )
        for key, owner in self.computing_tails.items():
            if (
                owner.status != RequestStatus.RUNNING
                or self.tail_claims.get(owner.request_id) != key
            ):
                raise AssertionError(
                    f"Request {owner.request_id!r} computes a partial page but is not running."
                )

    def _unclaim_tail(self, req: Request) -> None:
        """Ends `req`'s claim on its prompt's partial page, if it holds one."""
        key = self.tail_claims.pop(req.request_id, None)
        if key is not None and self.computing_tails.get(key) is req:
            del self.computing_tails[key]

    def _unclaim(self, req: Request, claimed) -> None:
        """Ends `req`'s claim on the (page index, hash) pairs `claimed`."""
        for _, h in claimed:
            if self.computing.get(h) is req:
                del self.computing[h]
