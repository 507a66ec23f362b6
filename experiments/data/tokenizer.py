"""Byte-level BPE tokenizer for the embedded tiny target, with a chat template.

Special tokens: ``<|bos|>``, ``<|eos|>`` (also ends every chat turn, so generation stops there),
``<|pad|>``, ``<|mask|>`` (reserved for block drafters), ``<|user|>`` and ``<|assistant|>``.
A chat renders as ``<|bos|><|user|>{q}<|eos|><|assistant|>{a}<|eos|>...``; with
``add_generation_prompt`` it ends in ``<|assistant|>``.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {
    "bos_token": "<|bos|>",
    "eos_token": "<|eos|>",
    "pad_token": "<|pad|>",
    "mask_token": "<|mask|>",
}
ROLE_TOKENS = {"user": "<|user|>", "assistant": "<|assistant|>", "system": "<|system|>"}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """Train a byte-level BPE on ``texts`` and wrap it as a ``transformers`` fast tokenizer."""
    specials = list(SPECIAL_TOKENS.values()) + list(ROLE_TOKENS.values())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        **SPECIAL_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    return fast
