"""The pending-prefix index: prompts routed to a worker, counted as cached there until its KV
events confirm them (services/core/pending_prefixes.py)."""

from services.core.pending_prefixes import PendingPrefixes

MS = 1_000_000


def test_pending_prefixes_match_the_longest_unexpired_leading_run_and_expire():
    p = PendingPrefixes(ttl_ms=10)  # buckets of 1 ms, ten of them live
    p.record("w0", (1, 2, 3, 4), 0)
    p.record("w1", (1, 2), 0)
    p.record("w0", (1, 2), 5 * MS)  # refreshes the first two blocks only
    assert p.match((1, 2, 3, 4, 5), 1 * MS) == {"w0": 4, "w1": 2}
    assert p.match((9, 2), 1 * MS) == {}
    p.expire(int(9.5 * MS))  # the 0 ms bucket lives until 10 ms
    assert p.match((1, 2, 3, 4), int(9.5 * MS)) == {"w0": 4, "w1": 2}
    p.expire(12 * MS)
    assert p.match((1, 2, 3, 4), 12 * MS) == {"w0": 2}  # w0's tail and all of w1 expired
    assert p.num_entries() == {"w0": 2}
    p.expire(15 * MS)
    assert p.num_entries() == {} and p.match((1, 2), 15 * MS) == {}
    assert p.firsts == {}  # the first-block map expires with the buckets


def test_pending_prefixes_forget_a_removed_worker_and_keep_the_newest_bucket_across_a_clock_step_back():
    p = PendingPrefixes(ttl_ms=10)
    p.record("w0", (1, 2, 3), 8 * MS)
    p.record("w1", (1, 2), 0)
    p.record("w0", (1, 2), 2 * MS)  # the router's clock stepped back: (1, 2) stays live from 8 ms
    assert p.firsts[1] == {"w0": 8, "w1": 0}
    assert p.match((1, 2, 3), 12 * MS) == {"w0": 3}  # w1's bucket (0 ms) is dead, w0's 8 ms one lives
    p.remove_worker("w0")
    assert p.match((1, 2, 3), 9 * MS) == {"w1": 2} and p.firsts == {1: {"w1": 0}}
    p.remove_worker("w1")
    assert p.firsts == {} and p.match((1, 2), 9 * MS) == {}
    # A bucket an expire dropped stays dropped if the clock then steps back into its lifetime.
    p.record("w0", (1, 2), 0)
    p.record("w0", (5, 6), 5 * MS)
    p.expire(12 * MS)
    assert p.match((1, 2), 5 * MS) == {} and p.match((5, 6), 5 * MS) == {"w0": 2}
