"""Prompt lookup's proposals on hand-made histories: the longest recent n-gram match, its continuation."""

from __future__ import annotations

from edge_sd.algorithms.lookup import NGRAM_MAX, NGRAM_MIN, LookupProposer


def test_continuation_of_the_longest_recent_match() -> None:
    history = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    lookup = LookupProposer(history)
    # [1, 2, 3] last occurred at the start (followed by 4); [2, 3] more recently (followed by 5):
    # the longer match wins.
    assert lookup.propose(3, history).candidates == [4, 9, 2]
    assert lookup.available(2) == 2 and lookup.propose(1, history).q is None


def test_no_match_and_incremental_history() -> None:
    history = [1, 2, 3]
    lookup = LookupProposer(history)
    assert lookup.available(4) == 0 and lookup.propose(4, history).candidates == []
    history += [7, 1, 2]  # the decoder extends the list in place
    assert lookup.propose(4, history).candidates == [3, 7, 1, 2]
    history += [3, 7]
    assert lookup.propose(2, history).candidates == [1, 2]  # [2, 3, 7] recurs: what followed it


def test_single_tokens_do_not_match() -> None:
    assert NGRAM_MIN >= 2 and NGRAM_MAX >= NGRAM_MIN
    history = [5, 1, 6, 1]
    assert LookupProposer(history).available(3) == 0
