"""Build the tiny test model: a random Qwen2-style network of about 1M parameters with a byte-level
BPE tokenizer trained locally and a ChatML chat template that renders tools.

Nothing is downloaded: tests and CI make it from scratch in about a second.
"""

from __future__ import annotations

import random
from pathlib import Path

from serving.models.chat_template import CHATML_TOOLS_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Plain added tokens (not special): they survive decoding with skip_special_tokens, as in Qwen.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first who "
    "may down side been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell does set three "
    "want air well also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again animal point "
    "mother world near build self earth father answer question problem apples cost total each many how "
    "weather city tool function call result search file user assistant system json name arguments"
).split()


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    """A deterministic mix of prose, arithmetic, JSON tool calls and chat markup to train the BPE on."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 20))).capitalize() + ".")
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            out.append(f"{a} + {b} = {a + b}. {a} * {b} = {a * b}. #### {a + b}")
        elif kind == 2:
            word = rng.choice(_WORDS)
            out.append(f'{{"name": "{word}", "arguments": {{"query": "{rng.choice(_WORDS)}", "n": {i}}}}}')
        else:
            out.append(f"<|im_start|>user\n{rng.choice(_WORDS)} {rng.choice(_WORDS)}?<|im_end|>\n")
    return out


def build_tokenizer(seed: int = 0, vocab_size: int = 1024):
    """Train a byte-level BPE (every byte is a token, so any text round-trips) with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TOOLS_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(MARKUP_TOKENS)
    return tokenizer


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny Qwen2 model (safetensors, config, tokenizer, chat template) to `out_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(seed)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
