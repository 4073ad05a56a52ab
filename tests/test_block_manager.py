"""Block allocation order: empty blocks before evicting cached prefixes, recently used memory first."""

from __future__ import annotations

import pytest

from hotswap.engine.block_manager import BlockManager
from hotswap.engine.sequence import Request, Sequence
from hotswap.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(Request("r", None, tokens, SamplingParams()), 0, tokens)


def run_prompt(bm: BlockManager, tokens: list[int]) -> Sequence:
    """Allocates `tokens` and marks them computed and committed, as a finished prefill would."""
    seq = make_seq(tokens)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    seq.num_computed_tokens = len(tokens)
    bm.commit(seq)
    return seq


def test_freed_blocks_are_reused_before_never_used_ones():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = run_prompt(bm, list(range(10)))  # 3 blocks
    used = set(first.block_table)
    bm.free_seq(first)
    second = run_prompt(bm, list(range(100, 110)))
    assert set(second.block_table) == used
    assert bm.num_free_blocks == 13


def test_empty_blocks_go_before_cached_prefixes_are_evicted():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    cached = run_prompt(bm, list(range(9)))  # 2 full (hashed) blocks + 1 partial
    hashed = set(cached.block_table[:2])
    bm.free_seq(cached)
    assert len(bm.cached) == 2
    # Needs 4 blocks: the partial block and the 3 never-used ones, not the cached prefix.
    other = run_prompt(bm, list(range(100, 115)))
    assert not hashed & set(other.block_table)
    bm.free_seq(other)
    again = run_prompt(bm, list(range(9)))
    assert again.num_cached_tokens == 8 and set(again.block_table[:2]) == hashed


def test_cached_prefixes_are_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    a = run_prompt(bm, [1, 2, 3, 4, 5])  # a full (hashed) block and a partial one each
    b = run_prompt(bm, [6, 7, 8, 9, 10])
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 5 and len(bm.cached) == 2
    c = run_prompt(bm, list(range(20, 33)))  # 4 blocks: the 3 empty ones, then a's prefix block, evicted
    assert bm.num_free_blocks == 1
    bm.free_seq(c)
    assert run_prompt(bm, [6, 7, 8, 9, 10]).num_cached_tokens == 4  # b's prefix survived
    assert run_prompt(bm, [1, 2, 3, 4, 5]).num_cached_tokens == 0


def test_reset_prefix_cache_makes_every_free_block_empty():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    seq = run_prompt(bm, list(range(12)))
    used = set(seq.block_table)
    bm.free_seq(seq)
    bm.reset_prefix_cache()
    assert not bm.cached and bm.num_free_blocks == 8
    again = run_prompt(bm, list(range(12)))
    assert again.num_cached_tokens == 0
    assert set(again.block_table) == used  # the same memory, recomputed


def test_open_sessions_keep_their_prefixes_while_other_traffic_churns_within_their_budget():
    """A session's cached blocks are evicted after every other free cached block; beyond the budget the oldest
    lose that priority; closing the session returns them to the common queue."""
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True, session_budget=3)
    bm.open_session("chat")
    turn = Sequence(Request("t1", None, list(range(13)), SamplingParams(), session_id="chat"), 0, list(range(13)))
    bm.allocate(turn)
    turn.num_computed_tokens = 13
    bm.commit(turn)  # 3 full blocks cached + 1 partial
    bm.free_seq(turn)
    assert len(bm.session_evictable) == 3 and not bm.evictable
    for start in range(100, 400, 20):  # other traffic: each prompt caches 4 blocks, more than the cache spares
        bm.free_seq(run_prompt(bm, list(range(start, start + 17))))
        bm.check_integrity([])
    assert bm.num_cached_tokens(make_seq(list(range(13)))) == 12  # the session's turn is still all there
    assert bm.num_cached_tokens(make_seq(list(range(100, 117)))) == 0  # early traffic was evicted
    bm.close_session("chat")
    assert not bm.session_evictable and len(bm.evictable) > 0
    for start in range(400, 600, 20):
        bm.free_seq(run_prompt(bm, list(range(start, start + 17))))
    assert bm.num_cached_tokens(make_seq(list(range(13)))) == 0  # closed: evicted in turn

    over = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True, session_budget=2)
    over.open_session("s")
    seq = Sequence(Request("t", None, list(range(13)), SamplingParams(), session_id="s"), 0, list(range(13)))
    over.allocate(seq)
    seq.num_computed_tokens = 13
    over.commit(seq)
    over.free_seq(seq)
    assert len(over.session_evictable) == 2 and len(over.evictable) == 1  # the oldest beyond the budget moved
    over.check_integrity([])
