"""The cached-block forest of the vLLM plugin: which hash chains are cached, by how many blocks.

vLLM reuses prefixes only (``find_longest_cache_hit`` stops at the first miss), so a block whose
hash has a cached child must stay while that child does: :class:`CachedForest` counts copies and
cached children per key, and :meth:`CachedForest.evictable` says which keys may lose a block.
:class:`ForestOverlay` is a copy-on-write view a plan changes without touching the forest.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence


class CachedForest:
    """The forest of cached hash chains: which hashes are cached, and by how many blocks.

    Keys are vLLM's hash keys (block hash + group id). A key's parent is the key of the block
    before it in the same request's chain; the chain is a pure function of the tokens, so a key
    always has the same parent. A link is kept while the key has copies or cached children.

    Attributes:
        watcher: called with every key whose :meth:`evictable` answer may have changed (and
            with ``None`` when every key's may have: :meth:`clear`); the free queue keeps its
            index of evictable keys current with it.
    """

    def __init__(self) -> None:
        self._parent: dict[Hashable, Hashable | None] = {}
        self._copies: dict[Hashable, int] = {}
        self._children: dict[Hashable, int] = {}
        self._key_of: dict[int, Hashable] = {}
        self.watcher: Callable[[Hashable | None], None] | None = None

    def _changed(self, key: Hashable | None) -> None:
        if self.watcher is not None:
            self.watcher(key)

    def learn_chain(self, keys: Sequence[Hashable], start: int = 0) -> None:
        """Records parent links of a request's chain of keys.

        Args:
            keys: the request's keys in order (key ``i``'s parent is key ``i - 1``).
            start: first index whose parent link to record.
        """
        for i in range(max(0, start), len(keys)):
            key = keys[i]
            if key in self._parent:
                continue
            parent = keys[i - 1] if i > 0 else None
            self._parent[key] = parent
            # NOTE: a key cached before its link was learned already has copies; count them.
            copies = self._copies.get(key, 0)
            if parent is not None and copies:
                self._children[parent] = self._children.get(parent, 0) + copies
                self._changed(parent)

    def add(self, block_id: int, key: Hashable) -> None:
        """Block ``block_id`` now caches ``key`` (its primary hash)."""
        if self._key_of.get(block_id) == key:
            return
        self.remove(block_id)
        self._key_of[block_id] = key
        self._copies[key] = self._copies.get(key, 0) + 1
        self._changed(key)
        parent = self._parent.get(key)
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            self._changed(parent)

    def remove(self, block_id: int) -> Hashable | None:
        """Block ``block_id`` lost its cached content (idempotent).

        Returns:
            The parent key whose child count fell, or ``None``.
        """
        key = self._key_of.pop(block_id, None)
        if key is None:
            return None
        left = self._copies.get(key, 0) - 1
        if left > 0:
            self._copies[key] = left
        else:
            self._copies.pop(key, None)
        self._changed(key)
        parent = self._parent.get(key)
        self._prune(key)
        if parent is None:
            return None
        kids = self._children.get(parent, 0) - 1
        if kids > 0:
            self._children[parent] = kids
        else:
            self._children.pop(parent, None)
        self._changed(parent)
        self._prune(parent)
        return parent

    def _prune(self, key: Hashable) -> None:
        """Forgets ``key``'s parent link once nothing counts on it (no copy, no cached child).

        NOTE: otherwise the links grow by one per hash ever cached, for as long as the server
        runs; a key cached again relearns its link (``learn_chain`` runs before the inserts).
        """
        if key not in self._copies and key not in self._children:
            self._parent.pop(key, None)

    def clear(self) -> None:
        """Every cached block lost its content (prefix-cache reset): counts and links go (a
        key cached again relearns its link)."""
        self._parent.clear()
        self._copies.clear()
        self._children.clear()
        self._key_of.clear()
        self._changed(None)

    def key_of(self, block_id: int) -> Hashable | None:
        """The key ``block_id`` is counted under, or ``None``."""
        return self._key_of.get(block_id)

    def parent(self, key: Hashable) -> Hashable | None:
        """The parent key of ``key`` (``None``: a root or unknown)."""
        return self._parent.get(key)

    def copies(self, key: Hashable) -> int:
        """Blocks caching ``key``."""
        return self._copies.get(key, 0)

    def children(self, key: Hashable) -> int:
        """Cached blocks whose parent key is ``key``."""
        return self._children.get(key, 0)

    def evictable(self, key: Hashable) -> bool:
        """Whether losing one block of ``key`` leaves every cached block reachable."""
        return self._copies.get(key, 0) > 1 or self._children.get(key, 0) == 0

    def copy(self) -> CachedForest:
        """A copy whose counts can be changed without touching this one (and unwatched)."""
        twin = CachedForest()
        twin._parent = dict(self._parent)  # NOTE: not shared: remove() prunes links
        twin._copies = dict(self._copies)
        twin._children = dict(self._children)
        twin._key_of = dict(self._key_of)
        return twin

    def __len__(self) -> int:
        return len(self._key_of)


class ForestOverlay:
    """A copy-on-write view of a :class:`CachedForest`: a plan's removals change only the view.

    Creating one costs O(1) (the forest's ``copy`` is O(cached blocks)); reads fall through to
    the forest for every key the view has not changed.

    Args:
        base: the forest (must not change while the view is used).
    """

    def __init__(self, base: CachedForest) -> None:
        self._base = base
        self._copies: dict[Hashable, int] = {}
        self._children: dict[Hashable, int] = {}
        self._removed: set[int] = set()

    def key_of(self, block_id: int) -> Hashable | None:
        """The key ``block_id`` is counted under in the view, or ``None``."""
        return None if block_id in self._removed else self._base.key_of(block_id)

    def parent(self, key: Hashable) -> Hashable | None:
        """The parent key of ``key`` (links are the forest's)."""
        return self._base.parent(key)

    def copies(self, key: Hashable) -> int:
        """Blocks caching ``key`` in the view."""
        got = self._copies.get(key)
        return self._base.copies(key) if got is None else got

    def children(self, key: Hashable) -> int:
        """Cached blocks whose parent key is ``key``, in the view."""
        got = self._children.get(key)
        return self._base.children(key) if got is None else got

    def evictable(self, key: Hashable) -> bool:
        """:meth:`CachedForest.evictable` in the view."""
        return self.copies(key) > 1 or self.children(key) == 0

    def remove(self, block_id: int) -> Hashable | None:
        """:meth:`CachedForest.remove` in the view.

        Returns:
            The parent key whose child count fell, or ``None``.
        """
        key = self.key_of(block_id)
        if key is None:
            return None
        self._removed.add(block_id)
        self._copies[key] = max(0, self.copies(key) - 1)
        parent = self._base.parent(key)
        if parent is None:
            return None
        self._children[parent] = max(0, self.children(parent) - 1)
        return parent
