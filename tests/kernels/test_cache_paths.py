"""The cache folder's JSON stores (:mod:`kernels.cache_paths`): a value computed once and read
back, under the store's lock, and what happens where the store or its lock cannot be used."""

from __future__ import annotations

import json

from kernels import cache_paths
from kernels.cache_paths import cache_dir, kept_in_store


def _counting(value: object) -> tuple[list[int], object]:
    calls: list[int] = []

    def compute() -> object:
        calls.append(1)
        return value

    return calls, compute


def test_a_value_is_computed_once_and_read_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "sub" / "store.json"
    calls, compute = _counting([1, 2])
    valid = lambda kept: isinstance(kept, list)  # noqa: E731
    assert kept_in_store(store, "k", valid, compute) == [1, 2] and len(calls) == 1
    assert kept_in_store(store, "k", valid, compute) == [1, 2] and len(calls) == 1  # read back
    assert json.loads(store.read_text()) == {"k": [1, 2]}
    # another key beside it, and a kept value the caller no longer accepts: computed over
    assert kept_in_store(store, "other", lambda kept: kept is True, lambda: True) is True
    assert kept_in_store(store, "k", lambda kept: kept == [3], lambda: [3]) == [3]
    assert json.loads(store.read_text()) == {"k": [3], "other": True}
    store.write_text("{not json")  # an unreadable store: computed over, and written again
    assert kept_in_store(store, "k", valid, compute) == [1, 2] and len(calls) == 2
    assert json.loads(store.read_text()) == {"k": [1, 2]}


def test_without_a_store_or_a_lock_the_value_is_still_computed(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls, compute = _counting(7)
    assert kept_in_store(None, "k", lambda kept: kept == 7, compute) == 7
    assert kept_in_store(None, "k", lambda kept: kept == 7, compute) == 7 and len(calls) == 2

    def no_locks(*args: object) -> None:
        raise OSError("locks not supported")

    monkeypatch.setattr(cache_paths.fcntl, "flock", no_locks)
    store = tmp_path / "store.json"
    assert kept_in_store(store, "k", lambda kept: kept == 7, compute) == 7 and len(calls) == 3
    assert kept_in_store(store, "k", lambda kept: kept == 7, compute) == 7 and len(calls) == 3  # kept all the same


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(cache_paths.CACHE_ENV, str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv(cache_paths.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "asymcache"
