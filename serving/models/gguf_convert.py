"""Load a GGUF checkpoint (the packaged demo model, or any llama.cpp file of an architecture transformers
reads) dequantized into a plain transformers model, and save it as a safetensors directory.

`from_pretrained(gguf_file=...)` would need `accelerate` just for a start-up check, and its result may
hold packed GGUF modules that `save_pretrained` cannot write. So this builds the model from the GGUF's
config and fills it with transformers' own dequantizer (the path `from_pretrained` itself takes for
llama-family files, so the weights are the ones it would load).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from serving.models.chat_template import CHATML_TOOLS_TEMPLATE
from serving.models.tensors import copy_tensors_strict

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write `gguf_path` to `out_dir` as float32 safetensors + config + generation config + tokenizer."""
    import torch

    started = time.perf_counter()
    tokenizer = load_gguf_tokenizer(gguf_path)
    model = load_gguf_model(gguf_path, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
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
