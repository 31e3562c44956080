"""Jobs for requests that name none: a turn joins the conversation its prompt continues.

Job-level admission, Continuum's pins and the per-job reuse estimates all key on a request's
``job_id``, but most agent frameworks never send one: each turn is a plain chat completion whose
prompt is the whole history so far. Without a job such a client got none of it (SWE, 128 agents on
19,934 blocks, simulated H200: mean JCT 290.5 s, `vllm-apc`'s 290.2, against 121.9 s for the same
default with job ids).

A turn of an agent loop extends its previous turn: the new prompt starts with the previous
prompt, then the previous reply as the chat template renders it, then the new messages. When a
request that names no job finishes, :class:`ImplicitJobs` keeps two keys of it, both chain hashes
of the prefix cache (so a lookup is one dictionary probe per full block of the new prompt):

- **prompt and reply**: the hash of the last full block of prompt + reply. A next turn whose
  prompt holds the reply token for token (a client that appends what it got; the bench's
  clients) matches it exactly.
- **prompt**: the hash of the prompt's last full block, with the tokens that follow it (the
  rest of the prompt and the reply's first :data:`REPLY_TOKENS`). A next turn matches when it
  holds that prefix and then those tokens: a template that renders the reply's start as
  generated (SmolLM2's tool call re-rendered from its parsed JSON parts from the generated
  tokens 17 tokens in, at the arguments' closing braces). The tail keeps apart conversations
  that share a long system prompt and a task that differs only in its last few tokens, and a
  request that repeats a turn (a retry, another sample of the same prompt: it holds no reply)
  starts a job of its own.

A template may also render an earlier reply otherwise from its start: a reasoning model's
(DeepSeek-R1's drops the ``<think>`` block of every earlier reply; Qwen3's does when the client
does not send it back). The new prompt then holds neither key's tokens, but the caller that
rendered it can still tell which turn it continues: the chat before its last assistant message,
rendered, is that turn's prompt. It names that turn's job (``continues``), which the request
takes when no key matched and the job still has its keys (no other continuation took them).

The longest match wins; among conversations equal so far, the oldest. A match takes the job's
keys (its next finish gives new ones), so two continuations of one turn (a fork) are two jobs.
A request that matches nothing starts a job (``implicit-N``). Nothing here changes a token: job
ids decide admission order, pins and eviction order, never the output.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

#: Tokens of the reply a prompt key checks after the prompt's own (the reply's start).
REPLY_TOKENS = 4
#: Conversations whose keys are kept by default (the least recently finished go first).
DEFAULT_MAX_CONVERSATIONS = 65_536
#: Prefix of the job ids :class:`ImplicitJobs` gives.
JOB_PREFIX = "implicit-"


class _Key(NamedTuple):
    """One key of a finished turn: its job, and the tokens a match must hold after the hashed
    prefix (none for a prompt-and-reply key)."""

    job: str
    tail: tuple[int, ...]


class ImplicitJobs:
    """The keys of finished turns that named no job, and the jobs they belong to.

    Invariant: every job with keys is in ``_by_job`` with exactly the hashes it is listed under
    in ``_by_hash``, and at most ``max_conversations`` jobs have keys.

    Args:
        block_size: the prefix cache's block size (the hashes' granularity).
        max_conversations: jobs whose keys are kept at most.
    """

    def __init__(self, block_size: int, max_conversations: int = DEFAULT_MAX_CONVERSATIONS) -> None:
        if block_size < 1 or max_conversations < 1:
            raise ValueError(f"implicit jobs: block_size and max_conversations must be >= 1, got "
                             f"{block_size!r}, {max_conversations!r}")
        self.block_size = block_size
        self.max_conversations = max_conversations
        self._by_hash: dict[Hashable, list[_Key]] = {}
        self._by_job: OrderedDict[str, tuple[Hashable, ...]] = OrderedDict()
        self._ids = itertools.count()
        #: requests matched to an earlier turn's job, and requests that started one
        self.matched = 0
        self.started = 0

    def __len__(self) -> int:
        return len(self._by_job)

    def assign(self, token_ids: Sequence[int], block_hashes: Sequence[Hashable], continues: str | None = None) -> str:
        """The job of a request that names none: the conversation it continues, or a new one.

        Args:
            token_ids: its prompt.
            block_hashes: the chain hashes of the prompt's full blocks.
            continues: the job of the turn the caller found the request continues (its chat
                before the last reply rendered to that turn's prompt), taken where no key
                matched and the job still has keys.

        Returns:
            The job id.
        """
        bs = self.block_size
        for k in range(len(block_hashes) - 1, -1, -1):
            start = (k + 1) * bs
            for key in self._by_hash.get(block_hashes[k], ()):
                if key.tail and tuple(token_ids[start : start + len(key.tail)]) != key.tail:
                    continue
                self._forget(key.job)
                self.matched += 1
                return key.job
        if continues is not None and continues in self._by_job:
            self._forget(continues)
            self.matched += 1
            return continues
        self.started += 1
        return f"{JOB_PREFIX}{next(self._ids)}"

    def on_finished(self, job: str, token_ids: Sequence[int], num_prompt_tokens: int,
                    block_hashes: Sequence[Hashable], keep: bool = False) -> None:
        """Keep the keys of a finished turn of ``job`` (replacing its earlier ones).

        Args:
            job: the turn's job.
            token_ids: its prompt and reply.
            num_prompt_tokens: the prompt's length.
            block_hashes: the chain hashes of ``token_ids``' full blocks (a stock vLLM's may
                lack the last one: the keys stop at the last block hashed).
            keep: keep the job's keys as well: another choice of the same turn (vLLM's
                ``n > 1``), which the next turn may continue as well.
        """
        bs = self.block_size
        kept = self._by_job.get(job, ()) if keep else ()
        if not keep:
            self._forget(job)
        keys: list[tuple[Hashable, _Key]] = []
        full = min(len(token_ids) // bs, len(block_hashes))
        prompt_full = min(num_prompt_tokens // bs, full)
        if full > prompt_full:
            # NOTE: only where the hashed blocks hold some of the reply: a prompt-only prefix
            # would let a repeat of the same prompt take the job
            keys.append((block_hashes[full - 1], _Key(job, ())))
        if prompt_full:
            start = prompt_full * bs
            tail = tuple(token_ids[start : num_prompt_tokens + REPLY_TOKENS])
            keys.append((block_hashes[prompt_full - 1], _Key(job, tail)))
        if not keys:
            return
        for h, key in keys:
            if key not in self._by_hash.setdefault(h, []):
                self._by_hash[h].append(key)
        # NOTE: each hash once: _forget drops every key of the job under it at once
        self._by_job[job] = tuple(dict.fromkeys([*kept, *(h for h, _ in keys)]))
        self._by_job.move_to_end(job)
        while len(self._by_job) > self.max_conversations:
            self._forget(next(iter(self._by_job)))

    def _forget(self, job: str) -> None:
        for h in self._by_job.pop(job, ()):
            keys = [k for k in self._by_hash[h] if k.job != job]
            if keys:
                self._by_hash[h] = keys
            else:
                del self._by_hash[h]

    def check_integrity(self) -> None:
        """Every job's hashes list it, every listed key belongs to a job that lists its hash."""
        assert len(self._by_job) <= self.max_conversations, "implicit jobs: over the bound"
        listed = {(h, k.job) for h, keys in self._by_hash.items() for k in keys}
        owned = {(h, job) for job, hashes in self._by_job.items() for h in hashes}
        assert listed == owned, f"implicit jobs: keys {len(listed)} against jobs' {len(owned)}"
        assert all(self._by_hash.values()), "implicit jobs: an empty key list"


__all__ = ["DEFAULT_MAX_CONVERSATIONS", "JOB_PREFIX", "REPLY_TOKENS", "ImplicitJobs"]
