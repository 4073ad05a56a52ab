"""Paged KV block allocation with reference counts, copy-on-write and a hash-chained prefix cache.

Invariants:
- A block with ref_count 0 is free. Free blocks holding a cached prefix block (found through `cached`) sit in
  `evictable`, least recently freed first; the others sit in `empty`, a stack. Allocation takes the top of
  `empty` before it evicts anything, so cached prefixes live as long as possible, and the most recently used
  memory is reused first: blocks never used (their pages not yet mapped by the OS) come last.
- A block is only written by a sequence that owns it alone (ref_count 1); a sequence about to write into a
  shared block first copies it (recorded in `pending_copies`, executed before the next forward pass).
- Only full blocks whose KV is computed are hashed. The hash of block i covers its tokens and block i-1's hash,
  so a hit on block i implies the whole prefix matches.
- A cached block keeps the routed experts of its tokens when the sequence that computed it recorded them; a
  sequence that records routes hits only blocks that kept theirs, and takes them with the block. A request with
  forced routes neither hits nor fills the cache (its KV depends on the routes it forces).
- Sessions (multi-turn conversations): free cached blocks last held by a request of an open session sit in
  `session_evictable` instead of `evictable`, at most `session_budget` of them (the oldest beyond it move to
  `evictable`). Allocation evicts from `evictable` before it touches them, so a conversation's next turn finds its
  prefix while other traffic churns the cache; closing the session returns them to `evictable`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from hotswap.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "hash", "ref_count", "routes", "session", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.routes: np.ndarray | None = None  # [block_size, sparse layers, top_k] while cached, when recorded
        self.session: str | None = None  # the open session whose request last held it


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, session_budget: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty: list[int] = list(reversed(range(num_blocks)))  # popped from the end: block 0 first
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.session_evictable: OrderedDict[int, None] = OrderedDict()  # free cached blocks of open sessions
        self.session_budget = session_budget
        self.open_sessions: set[str] = set()
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.pending_copies: list[tuple[int, int]] = []
        self.salt = 0  # mixed into the first block hash of every chain (the weight version, salt policy)
        self.prefix_hit_tokens = 0
        self.shared_block_refs = 0  # block references handed out by sharing instead of allocating

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty) + len(self.evictable) + len(self.session_evictable)

    def _blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _chain_hash(self, prev: int | None, tokens: tuple[int, ...]) -> int:
        return hash((prev, tokens))

    def _prefix_hits(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block id, hash) of the leading cached blocks of `seq`, leaving at least one token to compute. None for
        a request whose prompt logprobs are still to be computed: every prompt position must run."""
        if not self.enable_prefix_caching or seq.request.needs_prompt_logprobs or seq.request.forced_routes:
            return []
        hits: list[tuple[int, int]] = []
        prev: int | None = self._root(seq)
        bs = self.block_size
        for i in range((len(seq) - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self._chain_hash(prev, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            if seq.routes is not None and self.blocks[block_id].routes is None:
                break  # computed without recording routes: this sequence computes it again
            hits.append((block_id, h))
            prev = h
        return hits

    def _root(self, seq: Sequence) -> int | None:
        """Where `seq`'s hash chain starts: the weight salt, and the request's own cache salt when it has one."""
        salt, lora = seq.request.cache_salt, seq.request.lora
        root = self.salt if salt is None else hash((self.salt, "cache_salt", salt))
        return root if lora is None else hash((root, "lora", lora.uid))  # an adapter version's uid is never reused

    def _take_free(self) -> Block:
        if self.empty:
            block = self.blocks[self.empty.pop()]
        else:
            queue = self.evictable if self.evictable else self.session_evictable
            block = self.blocks[queue.popitem(last=False)[0]]
            assert block.hash is not None, "an evictable block holds a cached prefix"
            if self.cached.get(block.hash) == block.block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids, block.routes = None, (), None
        block.ref_count = 1
        return block

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:  # only a cached prefix block is referenced again while free
            if block_id in self.session_evictable:
                del self.session_evictable[block_id]
            else:
                del self.evictable[block_id]
        block.ref_count += 1

    def uncached_first_block(self, seq: Sequence) -> int | None:
        """The hash of `seq`'s first KV block where the prefix cache could share it with another sequence but does
        not hold it yet; None otherwise (caching off, prompt logprobs to compute, no full block, or cached)."""
        bs = self.block_size
        if (
            not self.enable_prefix_caching
            or seq.request.needs_prompt_logprobs
            or seq.request.forced_routes
            or len(seq) <= bs
        ):
            return None
        h = self._chain_hash(self._root(seq), tuple(seq.token_ids[:bs]))
        return None if h in self.cached else h

    def num_cached_tokens(self, seq: Sequence) -> int:
        """The tokens of `seq` that `allocate` would find in the prefix cache now."""
        return len(self._prefix_hits(seq)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._prefix_hits(seq)
        revived = sum(1 for b, _ in hits if self.blocks[b].ref_count == 0)
        return self._blocks_needed(len(seq)) - len(hits) <= self.num_free_blocks - revived

    def allocate(self, seq: Sequence) -> None:
        """Gives `seq` blocks for all its tokens, reusing cached prefix blocks. Call after can_allocate."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._prefix_hits(seq)
        for block_id, _ in hits:
            self._ref(block_id)
        seq.block_table = [b for b, _ in hits]
        seq.block_hashes = [h for _, h in hits]
        if seq.routes is not None:
            for i, (block_id, _) in enumerate(hits):
                routes = self.blocks[block_id].routes
                assert routes is not None  # _prefix_hits stops at a block without routes
                seq.routes.write(i * self.block_size, routes)
            seq.route_stale = (len(hits) * self.block_size, max(len(hits) * self.block_size, seq.routes.length))
        seq.cache_salt = self._root(seq)
        for _ in range(self._blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free().block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_draft_computed = seq.num_cached_tokens
        self.prefix_hit_tokens += seq.num_cached_tokens
        self.shared_block_refs += len(hits)

    def free_seq(self, seq: Sequence) -> None:
        """Releases the blocks of `seq` (most recent last, so a prefix outlives its tail in the cache)."""
        owned = set(seq.block_table)
        self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in owned]
        session = seq.request.session_id if seq.request.session_id in self.open_sessions else None
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                block.session = session
                if block.hash is None:
                    self.empty.append(block_id)
                elif session is not None and self.session_budget > 0:
                    self.session_evictable[block_id] = None
                else:
                    self.evictable[block_id] = None
        while len(self.session_evictable) > self.session_budget:  # the oldest beyond the budget lose priority
            self.evictable[self.session_evictable.popitem(last=False)[0]] = None
        seq.block_table = []
        seq.block_hashes = []

    def open_session(self, session_id: str) -> None:
        """From now on, the cached blocks `session_id`'s requests leave are evicted after the others."""
        self.open_sessions.add(session_id)

    def close_session(self, session_id: str) -> int:
        """Its cached blocks lose their priority (they stay cached, evicted in turn); returns how many it held."""
        self.open_sessions.discard(session_id)
        held = [b for b in self.session_evictable if self.blocks[b].session == session_id]
        for block_id in held:
            del self.session_evictable[block_id]
            self.evictable[block_id] = None
            self.blocks[block_id].session = None
        return len(held)

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether `seq` can get writable slots for its last token and `lookahead` more positions (speculation)."""
        pos = len(seq) - 1
        index = pos // self.block_size
        new = max(0, self._blocks_needed(len(seq) + lookahead) - len(seq.block_table))
        if index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1:
            new += 1  # copy-on-write of the shared block holding the last token
        return self.num_free_blocks >= new

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> None:
        """Makes the block holding the last token writable by `seq` alone, and gives it blocks up to `lookahead`
        positions further (those beyond the last token are its own: only the last token's block can be shared
        after a fork). Call after can_append."""
        index = (len(seq) - 1) // self.block_size
        if index < len(seq.block_table):
            old = self.blocks[seq.block_table[index]]
            if old.ref_count > 1:
                new = self._take_free()
                old.ref_count -= 1
                seq.block_table[index] = new.block_id
                self.pending_copies.append((old.block_id, new.block_id))
        while len(seq.block_table) < self._blocks_needed(len(seq) + lookahead):
            seq.block_table.append(self._take_free().block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent`; writes are separated later by copy-on-write."""
        for block_id in parent.block_table:
            self._ref(block_id)
        child.block_table = list(parent.block_table)
        self.shared_block_refs += len(parent.block_table)

    def commit(self, seq: Sequence, upto: int | None = None) -> None:
        """Registers the newly full, computed blocks of `seq` in the prefix cache (those within its first `upto`
        tokens when given: a draft model's KV, cached in the same blocks, may lag the target's)."""
        if not self.enable_prefix_caching or seq.request.forced_routes:
            return
        bs = self.block_size
        computed = seq.num_computed_tokens if upto is None else min(upto, seq.num_computed_tokens)
        for i in range(len(seq.block_hashes), computed // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self._chain_hash(seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id
            cached = self.blocks[self.cached[h]] if h in self.cached else None
            stale_start, stale_end = seq.route_stale
            fresh = not (i * bs < stale_end and (i + 1) * bs > stale_start)  # rows of this allocation's passes
            if (
                cached is not None
                and cached.routes is None
                and seq.routes is not None
                and fresh
                and (seq.routes.length >= (i + 1) * bs)
            ):
                cached.routes = seq.routes.rows(i * bs, (i + 1) * bs)  # the same tokens' routes, same weights

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix; blocks in use stay allocated."""
        self.cached.clear()
        for block in self.blocks:
            block.hash, block.token_ids, block.routes = None, (), None
        self.empty.extend(self.evictable)  # least recently freed deepest in the stack
        self.empty.extend(self.session_evictable)
        self.evictable.clear()
        self.session_evictable.clear()

    def check_integrity(self, seqs: Iterable[Sequence]) -> None:
        """Asserts the invariants above, given every sequence that may hold blocks: each block's ref_count equals
        the block tables referencing it; free blocks (ref_count 0) are exactly those in `empty` and `evictable`,
        each once; free + used = total; `cached` points only at blocks holding that hash. For tests and debugging:
        a violation is a bug in the engine."""
        refs = [0] * len(self.blocks)
        for seq in seqs:
            for block_id in seq.block_table:
                refs[block_id] += 1
        counted = [block.ref_count for block in self.blocks]
        assert refs == counted, f"ref counts {counted} differ from the block tables' references {refs}"
        free = list(self.empty) + list(self.evictable) + list(self.session_evictable)
        assert len(free) == len(set(free)), "a free block is listed twice"
        assert set(free) == {b.block_id for b in self.blocks if b.ref_count == 0}, "free lists != blocks unreferenced"
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert self.num_free_blocks + used == len(self.blocks), "free + used != total"
        assert all(self.blocks[b].hash is not None for b in [*self.evictable, *self.session_evictable]), (
            "an evictable block holds no prefix"
        )
        assert len(self.session_evictable) <= self.session_budget, "sessions hold more blocks than their budget"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h, f"cached hash {h} points at block {block_id} holding another"
