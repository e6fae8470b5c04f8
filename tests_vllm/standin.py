"""Stand-in models for vLLM's configs, written into a private Hugging Face cache.

vLLM's cache factories decide the cache mode from a ``ModelConfig``, which reads the model's
``config.json`` (and its tokenizer: without one vLLM treats the model as text-only and every
factory returns ``None``).  The tests run offline (``HF_HUB_OFFLINE=1``), so this writes, for
each model id the tests name, a snapshot holding a ``config.json`` of the real architecture
with small sizes and a word-level ``tokenizer.json``: no download, no weights.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers

_QWEN2_TEXT = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
}
_SIGLIP_VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 384,
    "patch_size": 14,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llava-hf/llava-onevision-qwen2-0.5b-ov-hf": {
        "architectures": ["LlavaOnevisionForConditionalGeneration"],
        "model_type": "llava_onevision",
        "image_token_index": 900,
        "video_token_index": 901,
        "text_config": _QWEN2_TEXT,
        "vision_config": _SIGLIP_VISION,
    },
    "llava-hf/llava-v1.6-mistral-7b-hf": {
        "architectures": ["LlavaNextForConditionalGeneration"],
        "model_type": "llava_next",
        "image_token_index": 900,
        "text_config": {**_QWEN2_TEXT, "model_type": "mistral"},
        "vision_config": {
            **_SIGLIP_VISION,
            "model_type": "clip_vision_model",
            "image_size": 336,
            "projection_dim": 64,
        },
    },
    "hf-internal-testing/tiny-random-Qwen2VLForConditionalGeneration": {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        **{k: v for k, v in _QWEN2_TEXT.items() if k != "model_type"},
        "vision_start_token_id": 905,
        "vision_end_token_id": 906,
        "image_token_id": 907,
        "video_token_id": 908,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 4,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
        },
    },
}
"""``config.json`` of every model id the vLLM tests use offline."""

SPECIAL_TOKENS = {
    "<unk>": 0,
    "<s>": 1,
    "</s>": 2,
    "<image>": 900,
    "<video>": 901,
    "<|vision_start|>": 905,
    "<|vision_end|>": 906,
    "<|image_pad|>": 907,
    "<|video_pad|>": 908,
}
"""Special tokens (the placeholders of every stand-in) and their ids."""

_QWEN2_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

EXTRA_FILES: dict[str, dict[str, Any]] = {
    "hf-internal-testing/tiny-random-Qwen2VLForConditionalGeneration": {
        "preprocessor_config.json": _QWEN2_VL_PREPROCESSOR,
        "video_preprocessor_config.json": {
            **_QWEN2_VL_PREPROCESSOR,
            "video_processor_type": "Qwen2VLVideoProcessor",
        },
    },
}
"""Processor files of the stand-ins whose tests run the Hugging Face processor."""


def _tokenizer_json() -> str:
    """A word-level tokenizer: the special tokens, filler words for the other ids."""
    vocab = {f"w{i}": i for i in range(1000)}
    for word in [w for w, i in vocab.items() if i in SPECIAL_TOKENS.values()]:
        del vocab[word]
    vocab.update(SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer.to_str()


def write_hf_cache(hf_home: Path) -> None:
    """Write a snapshot of every model in :data:`CONFIGS` under ``hf_home/hub`` (the layout
    ``huggingface_hub`` resolves offline); idempotent."""
    files = {
        "tokenizer.json": _tokenizer_json(),
        "tokenizer_config.json": json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 4096,
            }
        ),
    }
    for model_id, config in CONFIGS.items():
        repo = hf_home / "hub" / f"models--{model_id.replace('/', '--')}"
        extra = {name: json.dumps(v) for name, v in EXTRA_FILES.get(model_id, {}).items()}
        contents = {"config.json": json.dumps(config, indent=1), **files, **extra}
        revision = hashlib.sha1(json.dumps(contents, sort_keys=True).encode()).hexdigest()
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        for name, text in contents.items():
            (snapshot / name).write_text(text)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
