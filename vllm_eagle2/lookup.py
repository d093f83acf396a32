"""Lookup drafts: continuations of a request's longest repeated suffix, from its own text.

Much served text repeats what came before: a summary quotes its source, an edit rewrites the code it
was given, a second answer reworks the first. Where the text so far ends with a span that occurred
earlier, the tokens that followed that earlier occurrence are a free draft.

:class:`SuffixIndex` holds one request's text (prompt and output so far) as a suffix automaton,
extended token by token in amortised constant time. Its state for the whole text links to the
state of the longest suffix that also ends somewhere earlier; that state's first end position gives
an earlier occurrence, and the tokens after it are the continuation (copied on as an overlapping copy
where they reach the text's end). Memory is bounded: the index
covers at most the last ``2 * window`` tokens (it is rebuilt from the last ``window`` tokens when it
would exceed that; a rebuild every ``window`` tokens keeps the update linear, amortised).

:class:`OutputCache` (``lookup_cache``) holds recent requests' outputs in one such index, so that a
request can continue a span that an earlier request wrote: a follow-up that reworks an answer
served before, a template the server keeps filling in (as vLLM's suffix decoding caches responses).

Engine-free: host integers in, host integers out; the engine batches the answers into tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["DEFAULT_WINDOW", "OutputCache", "SuffixIndex"]

#: Tokens a request's index covers at least (its last ``window`` tokens); at most twice as many.
DEFAULT_WINDOW = 4096


class SuffixIndex:
    """A suffix automaton of the last tokens of one request's text.

    States are list indices (0 = the empty string). Per state: ``_len`` the longest string it
    stands for, ``_link`` its suffix link, ``_next`` its transitions (token -> state) and
    ``_first`` the end position (in ``_tokens``) of its first occurrence.
    """

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1; got {window}")
        self.window = window
        self._reset([])

    def _reset(self, tokens: list[int]) -> None:
        self._tokens: list[int] = []
        self._len, self._link, self._first = [0], [-1], [-1]
        self._next: list[dict[int, int]] = [{}]
        self._last = 0
        for token in tokens:
            self._extend(token)

    def __len__(self) -> int:
        """Tokens indexed (at most ``2 * window``)."""
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The text indexed: the request's last ``len(self)`` tokens."""
        return tuple(self._tokens)

    @property
    def num_states(self) -> int:
        """States held: at most ``2 * len(self) - 1`` (1 when empty)."""
        return len(self._len)

    def tail(self, n: int) -> list[int]:
        """The text's last ``n`` tokens (fewer if it is shorter)."""
        return self._tokens[-n:] if n > 0 else []

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the text."""
        for token in tokens:
            if len(self._tokens) >= 2 * self.window:
                self._reset(self._tokens[-self.window :])
            self._extend(int(token))

    def _extend(self, token: int) -> None:
        lengths, links, nexts, firsts = self._len, self._link, self._next, self._first
        pos = len(self._tokens)
        self._tokens.append(token)
        cur = len(lengths)
        lengths.append(lengths[self._last] + 1)
        links.append(0)
        nexts.append({})
        firsts.append(pos)
        p = self._last
        while p != -1 and token not in nexts[p]:
            nexts[p][token] = cur
            p = links[p]
        if p != -1:
            q = nexts[p][token]
            if lengths[p] + 1 == lengths[q]:
                links[cur] = q
            else:
                clone = len(lengths)
                lengths.append(lengths[p] + 1)
                links.append(links[q])
                nexts.append(dict(nexts[q]))
                firsts.append(firsts[q])
                while p != -1 and nexts[p].get(token) == q:
                    nexts[p][token] = clone
                    p = links[p]
                links[q] = clone
                links[cur] = clone
        self._last = cur

    def match(self, max_tokens: int) -> tuple[int, list[int]]:
        """The longest suffix of the text that also ends earlier in it, and what followed it there.

        Returns ``(length, continuation)``: the suffix's length in tokens (0 = no token of the
        text's last one occurred before) and ``max_tokens`` tokens that followed its first earlier
        occurrence (empty when ``length`` is 0). The copy runs on into the text's own end as an
        overlapping copy does (LZ77's): an occurrence ending ``p`` tokens before the end repeats
        with period ``p``, so a text caught in a loop gets the loop's next ``max_tokens`` tokens.
        """
        state = self._link[self._last] if self._tokens else -1
        if state <= 0:
            return 0, []
        start = self._first[state] + 1
        period = len(self._tokens) - start
        return self._len[state], [self._tokens[start + i % period] for i in range(max_tokens)]

    def find(self, query: Sequence[int], max_tokens: int) -> tuple[int, list[int]]:
        """The longest suffix of ``query`` (another text's last tokens) that occurs in this text, and
        what followed its first occurrence here.

        Returns ``(length, continuation)``: up to ``max_tokens`` tokens, cut before the first negative
        token (a separator, :class:`OutputCache`) or at the text's end; ``(0, [])`` when not even
        the query's last token occurs. Time linear in ``len(query)``: the query walks the automaton,
        following suffix links where it cannot go on (matching statistics).
        """
        lengths, links, nexts = self._len, self._link, self._next
        state, length = 0, 0
        for token in query:
            while state and token not in nexts[state]:
                state = links[state]
                length = lengths[state]
            if token in nexts[state]:
                state, length = nexts[state][token], length + 1
        if length == 0:
            return 0, []
        continuation = []
        for token in self._tokens[self._first[state] + 1 : self._first[state] + 1 + max_tokens]:
            if token < 0:
                break
            continuation.append(token)
        return length, continuation


class OutputCache:
    """The last ``tokens``..``2 * tokens`` tokens of finished requests' outputs, each followed by a
    separator of its own (a negative id that occurs once), so that no match spans two outputs."""

    def __init__(self, tokens: int) -> None:
        self._index = SuffixIndex(window=tokens)
        self._outputs = 0

    def __len__(self) -> int:
        """Tokens held, separators included."""
        return len(self._index)

    @property
    def num_states(self) -> int:
        """The index's states: at most ``2 * len(self) - 1``."""
        return self._index.num_states

    def add(self, output: Sequence[int]) -> None:
        """Keep a finished request's output (nothing for an empty one)."""
        if len(output):
            self._outputs += 1
            self._index.extend([*output, -self._outputs])

    def find(self, query: Sequence[int], max_tokens: int) -> tuple[int, list[int]]:
        """:meth:`SuffixIndex.find` over the outputs held."""
        return self._index.find(query, max_tokens)
