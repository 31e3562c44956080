"""Prompt encoding off the engine thread: :class:`PromptEncoder` (a private copy of the
engine's tokenizer on a worker thread of its own, behind a length check that needs no tokenizer).

NOTE: separate from ``engine_client.py``: the encoder never touches the engine, only a copy of
its tokenizer, so it is its own piece of the threading model, not the engine thread's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
from typing import Any


class PromptEncoder:
    """Encodes text prompts off the engine thread, after a length check that needs no tokenizer.

    A private copy of the engine's tokenizer runs on one worker thread of its own, so a long
    prompt never stalls the engine's steps (nor the event loop), and the copy is never used by
    two threads at once. A prompt with more characters than ``max_model_len`` tokens could
    cover (no token is longer than the vocabulary's longest entry) is rejected unread.

    Args:
        tokenizer: the engine's HF tokenizer.
        max_model_len: the engine's context limit.
    """

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_chars = max_model_len * max(1, longest)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="asymcache-tokenize"
        )

    def check(self, text: str) -> None:
        """Reject a prompt that cannot fit, by its length in characters.

        Raises:
            ValueError: naming ``prompt``.
        """
        if len(text) > self.max_chars:
            raise ValueError(
                f"prompt: {len(text)} characters cannot fit max_model_len (at most {self.max_chars} characters)"
            )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (checked first; runs on the caller's thread)."""
        self.check(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def encode_async(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """:meth:`encode` on the encoder's worker thread."""
        self.check(text)
        return await asyncio.wrap_future(self._pool.submit(self.encode, text, add_special_tokens))

    async def decode_async(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens included), on the encoder's worker thread."""
        return await asyncio.wrap_future(self._pool.submit(self.tokenizer.decode, token_ids))

    def close(self) -> None:
        """Stop the worker thread (encodings not yet started are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
