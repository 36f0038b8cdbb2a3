"""A suffix trie bounded by depth, with counts: for every sequence it holds and every start in it, the
path of the next `max_depth` tokens, each node counting the occurrences of its string. SuffixDecoding
(Oliaro et al., 2024) drafts from it by following the most frequent continuations.

Only strings seen at least twice get a node per token. A string seen once is a *tail*: one node that
points at its occurrence (`seq`, `end`), its continuation read from the sequence itself. Natural text
repeats little, so a tree over n tokens holds a few nodes per token instead of `max_depth`, and a
growing sequence's tails grow with it for free.

Sequences are added a token at a time through a `Cursor`, which keeps one open path per start still
shorter than `max_depth` (the suffixes of the sequence so far): appending a token extends each of them
by one node, O(max_depth) per token whatever the sequence's length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class Node:
    """The string on the path from the root (`depth` tokens, the last `token`), seen `count` times.
    A tail (`children is None`, count 1) continues as `seq[end + 1 :]` up to the tree's depth."""

    __slots__ = ("best", "children", "count", "depth", "end", "seq", "token")

    def __init__(self, token: int, depth: int, seq: list[int] | None = None, end: int = 0) -> None:
        self.token = token
        self.depth = depth
        self.count = 1
        self.children: dict[int, Node] | None = None if seq is not None else {}
        self.best: Node | None = None  # the child with the highest count (the first to reach it)
        self.seq = seq
        self.end = end  # a tail's occurrence ends at seq[end]


class Cursor:
    """A sequence being added to a tree: its tokens and the open paths of its last starts."""

    __slots__ = ("paths", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # paths[k]: the deepest node known on the k-th open start's path (oldest, so longest, first).
        # It may sit above the path's end: the rest is a tail, or a tail since made explicit, which is
        # walked down when next needed.
        self.paths: list[Node] = []


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node(-1, 0)
        self.root.count = 0  # one per start held

    def extend(self, cursor: Cursor, tokens: Iterable[int]) -> None:
        """Append `tokens` to the cursor's sequence, counting every suffix they end."""
        seq, paths, root, depth_limit = cursor.tokens, cursor.paths, self.root, self.max_depth
        for token in tokens:
            n = len(seq)  # the new token's index
            seq.append(token)
            paths.append(root)
            root.count += 1
            first = n - len(paths) + 1  # the start of paths[0]
            for k in range(len(paths)):
                node = paths[k]
                length = n - first - k  # tokens on this path before `token`
                # A path's tail may have been made explicit (another occurrence came): walk down to its end.
                while node.depth < length and node.children is not None:
                    node = node.children[seq[first + k + node.depth]]
                if node.children is None:  # this path's own tail: it reads `seq`, so it grew already
                    paths[k] = node
                    continue
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node(token, length + 1, seq, n)
                else:
                    child.count += 1
                    if child.children is None:
                        self._split_tail(child)
                if node.best is None or child.count > node.best.count:
                    node.best = child
                paths[k] = child
            if len(paths) == depth_limit:  # the oldest path reached the depth: it is complete
                del paths[0]

    def _split_tail(self, node: Node) -> None:
        """A tail seen a second time gets its continuation as an explicit child (that tail's next
        token, if any within the depth), seen once. Paths are extended oldest first, so when that
        token is the one being appended, its path already counted it (it is the older occurrence)."""
        seq, end = node.seq, node.end
        assert seq is not None
        node.children, node.seq = {}, None
        if node.depth < self.max_depth and end + 1 < len(seq):
            token = seq[end + 1]
            node.children[token] = node.best = Node(token, node.depth + 1, seq, end + 1)

    def remove(self, seq: Sequence[int]) -> None:
        """Take back every count a whole sequence added (`seq` as it was extended)."""
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for i in range(start, min(start + self.max_depth, len(seq))):
                assert node.children is not None  # a tail below here was this sequence's: it is gone
                child = node.children[seq[i]]
                child.count -= 1
                if child.count == 0:  # only this sequence went this way: drop the whole branch
                    del node.children[seq[i]]
                if child is node.best:  # the root's is never read: no need to search its many children
                    node.best = None if node is self.root else max(node.children.values(), key=_count, default=None)
                if child.count == 0:
                    break
                node = child

    def locate(self, tokens: Sequence[int], start: int) -> tuple[Node, int] | None:
        """Where `tokens[start:]` leads from the root: (node, tokens read past it in its tail), or
        None if the tree does not hold that string."""
        node, extra = self.root, 0
        for i in range(start, len(tokens)):
            if node.children is None:
                assert node.seq is not None
                j = node.end + 1 + extra
                if node.depth + extra >= self.max_depth or j >= len(node.seq) or node.seq[j] != tokens[i]:
                    return None
                extra += 1
            else:
                found = node.children.get(tokens[i])
                if found is None:
                    return None
                node = found
        return node, extra

    def draft(self, node: Node, extra: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """Greedily follow the most frequent continuation from (node, extra) for at most `limit`
        tokens while the path's probability (the product of count / parent count) stays at least
        `min_prob`; returns the tokens and their summed probabilities (the expected number accepted)."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < limit:
            if node.children is None:  # seen once: its continuation is certain given this node
                assert node.seq is not None
                begin = node.end + 1 + extra
                stop = min(node.end + 1 + self.max_depth - node.depth, len(node.seq), begin + limit - len(tokens))
                tokens += node.seq[begin:stop]
                score += prob * max(0, stop - begin)
                break
            child = node.best
            if child is None:
                break
            prob *= child.count / node.count
            if prob < min_prob:
                break
            tokens.append(child.token)
            score += prob
            node, extra = child, 0
        return tokens, score

    def open_matches(self, cursor: Cursor) -> Iterable[tuple[int, Node]]:
        """The cursor's suffixes that this tree (the one the cursor extends) has seen continue: (suffix
        length, its node), longest first. Nodes still tails are the sequence's own ends: skipped."""
        seq, paths = cursor.tokens, cursor.paths
        first = len(seq) - len(paths)
        for k in range(len(paths)):
            node, length = paths[k], len(paths) - k
            while node.depth < length and node.children is not None:
                node = node.children[seq[first + k + node.depth]]
            paths[k] = node
            if node.depth == length and node.best is not None:
                yield length, node


def _count(node: Node) -> int:
    return node.count
