"""Load a GGUF checkpoint (the packaged demo model, or any llama.cpp file of an architecture transformers
reads) dequantized into a plain transformers model, and save it as a safetensors directory.

`from_pretrained(gguf_file=...)` would need `accelerate` just for a start-up check, and its result may
hold packed GGUF modules that `save_pretrained` cannot write. So this builds the model from the GGUF's
config and fills it with transformers' own dequantizer (the path `from_pretrained` itself takes for
llama-family files, so the weights are the ones it would load).

A conversion is slow enough to wonder about (reading the GGUF's tokenizer and metadata takes longer than
dequantizing its tensors), so a bar on stderr, drawn only when stderr is a terminal as every Flywheel bar,
counts its steps; transformers draws its own over the tensors it dequantizes.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving.models.chat_template import CHATML_TOOLS_TEMPLATE
from serving.models.tensors import copy_tensors_strict

if TYPE_CHECKING:
    import torch
    from tqdm import tqdm
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
CONVERSION_STEPS = ("read the tokenizer", "read the weights", "write safetensors")


def conversion_bar(gguf_path: Path, enabled: bool | None) -> tqdm[Any]:
    """The bar over `CONVERSION_STEPS` on stderr; `enabled` None: only when stderr is a terminal."""
    from tqdm import tqdm

    return tqdm(total=len(CONVERSION_STEPS), desc=f"convert {gguf_path.name}", unit="step", file=sys.stderr,
                disable=None if enabled is None else not enabled, dynamic_ncols=True)


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool | None = None) -> Path:
    """Write `gguf_path` to `out_dir` as float32 safetensors + config + generation config + tokenizer.
    `progress`: the bar over its steps (None: only on a terminal)."""
    import torch

    started = time.perf_counter()
    with conversion_bar(gguf_path, progress) as bar:
        def step(index: int) -> None:
            if index:
                bar.update(1)
            bar.set_postfix_str(CONVERSION_STEPS[index])

        step(0)
        tokenizer = load_gguf_tokenizer(gguf_path)
        step(1)
        model = load_gguf_model(gguf_path, dtype=torch.float32)
        step(2)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        bar.update(1)
    logger.info("Converted %s to %s in %.1f s", gguf_path, out_dir, time.perf_counter() - started)
    return out_dir


def load_gguf_model(gguf_path: Path, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The GGUF's weights, dequantized, in the transformers model its metadata describes (eval mode)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    dtype = dtype or torch.float32
    started = time.perf_counter()
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=dtype)
    copy_tensors_strict(model, parsed["tensors"], source=str(gguf_path))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    logger.info("Loaded %s from GGUF in %.1f s", gguf_path.name, time.perf_counter() - started)
    return model.eval()


def load_gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer with its chat template; a ChatML one is set if the file has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        vocab = tokenizer.get_vocab()
        if all(token in vocab for token in CHATML_TOKENS):
            logger.warning("%s has no chat template; using ChatML", gguf_path.name)
            tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
            tokenizer.eos_token = "<|im_end|>"
        else:
            logger.warning("%s has no chat template and no ChatML tokens; chat requests will fail", gguf_path)
    return tokenizer
