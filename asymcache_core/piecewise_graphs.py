"""Piecewise CUDA graphs for mixed steps (prefill, hole and decode tokens together).

An eager step of an 8B model issues ~1,000 kernel launches; below ~500 tokens the host's
launch rate, not the GPU, sets its pace (measured on the H200: an eager floor of ~17 ms up to a
512-token knee, while the GPU work of a 256-token step is ~6 ms). A whole mixed step cannot be one
graph: its MSA launch plan (tile classes, grids, KV splits) changes with every step's segments.
Everything between two attention calls can: for a fixed token count it is the same kernels on
the same buffers. So each step runs ``L + 1`` graph pieces with the eager MSA between them
(vLLM V1's piecewise graphs follow the same cut):

- piece 0: embeddings, rotary tables, layer 0 up to attention (norm, QKV, rotary, K/V store);
- piece ``i`` (1..L-1): layer ``i-1`` after attention (output projection, residual, MLP) and
  layer ``i`` up to attention;
- piece ``L``: the last layer after attention.

Token counts are padded up to the next captured size. Padding rows have token 0 at position
0 and KV slot ``-1``: they store nothing, belong to no MSA segment, and rows never mix outside
attention, so the real rows' values do not depend on them. The logits of the sampled rows are
computed eagerly from the last piece's output.

Pieces share static inputs (token ids, positions, slots), static query and attention-output
buffers (the eager MSA reads one and writes the other) and one memory pool. The residual
stream passes from piece to piece in place: a piece's output is the next piece's input, and
the pool only reuses its memory after that piece has read it, in capture order as in replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from asymcache_core.cuda_graphs import capturing
from kernels.dispatch import AttentionBackend
from kernels.metadata import MSAMetadata


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture for steps of at most ``max_tokens`` tokens, ascending: powers of
    two up to 256, then steps of 128 (padding costs at most a quarter of a step above 256)."""
    if max_tokens < 1:
        return []
    sizes = [s for s in (16, 32, 64, 128, 256) if s < max_tokens]
    sizes += list(range(384, max_tokens, 128))
    return sorted({*sizes, max_tokens})


class _Piece:
    """One captured piece: ``fn`` reads static buffers and the previous pieces' outputs
    (through a shared state dict) and writes its own outputs into that dict.

    With ``capture=False`` the piece runs ``fn`` eagerly each time (the same code path on any
    device, so padding and the piece boundaries are tested without a GPU).
    """

    def __init__(self, fn: Callable[[], None], state: dict[str, Any], capture: bool, pool: Any) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:
            # NOTE: the warm-up (Triton compiles and cuBLAS picks its kernels outside the
            # capture) replaces the state's tensors with eager ones; the capture must read the
            # previous pieces' captured outputs instead, and they must stay referenced meanwhile
            # or the pool would hand their memory to this piece.
            captured_inputs = dict(state)
            fn()
            state.clear()
            state.update(captured_inputs)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool):
                fn()
            self.graph = graph

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class PiecewiseGraphs:
    """Per captured token count, the ``L + 1`` pieces of a step between its attention calls.

    Args:
        model: the causal LM; it provides ``embed``, ``embed_tokens``, ``rotary``, ``pre_attention``,
            ``post_attention``, ``compute_logits`` and ``layers`` (see ``models/llama.py``).
        kv_caches: per-layer paged caches.
        backend: the attention backend (its ``store_kv`` must skip negative slots).
        sizes: token counts to capture (:func:`piecewise_sizes`).
        device: where the model runs.
        capture: capture CUDA graphs (CUDA only); ``False`` runs the same pieces eagerly.
    """

    def __init__(
        self,
        model: Any,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        sizes: list[int],
        device: torch.device,
        capture: bool = True,
    ) -> None:
        if not sizes:
            raise ValueError("sizes: at least one token count to capture")
        if capture and device.type != "cuda":
            raise ValueError("enforce_eager: CUDA graphs need a CUDA device")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.sizes = sorted(sizes)
        cfg = model.config
        largest = self.sizes[-1]
        dtype = model.embed_tokens.weight.dtype
        # rows: input ids, positions, slots (every row starts as padding: slot -1)
        self.token_rows = torch.zeros((3, largest), dtype=torch.long, device=device)
        self.token_rows[2] = -1
        self.query = torch.zeros((largest, cfg.num_attention_heads, cfg.head_dim), dtype=dtype, device=device)
        self.attn_out = torch.zeros((largest, cfg.num_attention_heads * cfg.head_dim), dtype=dtype, device=device)
        self.scale = model.layers[0].self_attn.scale  # the model's own softmax scale
        self.pieces: dict[int, tuple[list[_Piece], dict[str, Any]]] = {}
        pool = None
        with torch.inference_mode():
            # NOTE: largest first, so the smaller sizes fit in the memory pool it leaves.
            for size in reversed(self.sizes):
                state: dict[str, Any] = {}
                pieces: list[_Piece] = []
                for fn in self._piece_fns(size, state):
                    pieces.append(_Piece(fn, state, capture, pool))
                    if capture and pool is None:
                        pool = pieces[-1].graph.pool()  # type: ignore[union-attr]
                self.pieces[size] = (pieces, state)
        if capture:
            torch.cuda.synchronize(device)

    def _piece_fns(self, size: int, state: dict[str, Any]) -> list[Callable[[], None]]:
        model, backend, kv = self.model, self.backend, self.kv_caches
        ids, positions, slots = self.token_rows[0, :size], self.token_rows[1, :size], self.token_rows[2, :size]
        query, attn_out = self.query[:size], self.attn_out[:size]
        num_layers = len(kv)

        def first() -> None:
            h = model.embed(ids)
            state["rope"] = model.rotary.tables(positions, h.dtype)
            q, state["residual"] = model.pre_attention(0, h, None, state["rope"], kv[0], slots, backend)
            query.copy_(q)

        def middle(index: int) -> Callable[[], None]:
            def fn() -> None:
                h, residual = model.post_attention(index - 1, attn_out, state["residual"], backend.dense)
                q, state["residual"] = model.pre_attention(index, h, residual, state["rope"], kv[index], slots, backend)
                query.copy_(q)

            return fn

        def last() -> None:
            state["h"], state["residual"] = model.post_attention(
                num_layers - 1, attn_out, state["residual"], backend.dense
            )

        return [first, *(middle(i) for i in range(1, num_layers)), last]

    def size_for(self, num_tokens: int) -> int | None:
        """The smallest captured size that holds ``num_tokens``, ``None`` when none does."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        meta: MSAMetadata,
        logits_rows: torch.Tensor,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
        hidden: bool = False,
    ) -> Any:
        """Runs one step through the pieces of the smallest size that fits.

        Args:
            input_ids: the step's packed tokens.
            positions: their absolute positions.
            slots: their KV slots.
            meta: the step's MSA metadata (prepared by the backend).
            logits_rows: ``[R]`` device rows whose logits are needed.
            fill: ``(rows, tokens)`` on the device: input ids written after ``input_ids`` (the
                tokens a step still in flight samples, async scheduling).
            hidden: return the rows' final ``(h, residual)`` instead of their logits
                (:meth:`~asymcache_core.models.llama.LlamaForCausalLM.final_hidden`).

        Returns:
            ``[R, vocab]`` float32 logits (or the hidden pair), or ``None`` when the step is
            larger than any size.
        """
        num = len(input_ids)
        size = self.size_for(num)
        if size is None or num == 0:
            return None
        pad = size - num
        rows = torch.tensor(
            [input_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad], dtype=torch.long
        )
        self.token_rows[:, :size].copy_(rows, non_blocking=True)
        if fill is not None:
            self.token_rows[0].index_copy_(0, *fill)
        pieces, state = self.pieces[size]
        kv = self.kv_caches
        pieces[0]()
        for index in range(len(kv)):
            o = self.backend.attend(self.query[:num], kv[index][0], kv[index][1], meta, self.scale)
            self.attn_out[:num].copy_(o.reshape(num, -1))
            pieces[index + 1]()
        if hidden:
            return state["h"][logits_rows], state["residual"][logits_rows]
        return self.model.compute_logits(state["h"], state["residual"], logits_rows, self.backend.dense)
