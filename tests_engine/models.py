"""Tiny multimodal models for a real vLLM engine, written at test time (no model hub).

Each builder writes a directory vLLM loads as ``LLM(model=directory, load_format="dummy")``:
a config of the real architecture with tiny sizes, the real Hugging Face processor classes
saved with ``save_pretrained``, and a word-level tokenizer built with ``tokenizers``.  The
weights are vLLM's dummy ones (random, the same in every engine of one vLLM version), so the
text is gibberish, but every engine given the same prompts and images generates the same
greedy tokens, which is what the tests compare.

* :func:`write_llava`: LLaVA 1.5 (a CLIP vision tower, a Llama text model): every image is
  resized to one size, so every item is the same size.
* :func:`write_qwen2_vl`: Qwen2-VL (its own vision tower, a Qwen2 text model): an image keeps
  its aspect and area (within ``min_pixels``/``max_pixels``) and a video is a stack of
  frames, so items differ in size by orders of magnitude.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

VOCAB_SIZE = 1024

LLAVA_IMAGE_SIZE = 224
"""LLaVA's images become 3 x 224 x 224 float32 (588 KiB): 256 image tokens each."""

LLAVA_SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": 1000}
QWEN2_VL_SPECIAL = {
    "<unk>": 0,
    "<|endoftext|>": 1,
    "<|im_end|>": 2,
    "<|vision_start|>": 1000,
    "<|vision_end|>": 1001,
    "<|image_pad|>": 1002,
    "<|video_pad|>": 1003,
}

INIT_STD = 0.3
"""Weights are drawn with this deviation (Hugging Face's default, 0.02, makes a tiny model's
tokens nearly blind to the images): every token follows the pixels of every image."""

_TINY_TEXT = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,  # 4 heads of 32: the smallest head vLLM's CPU attention runs
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "initializer_range": INIT_STD,
}


def _tokenizer(special: dict[str, int], **tokens: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: ``special`` at their ids, words ``w<i>`` for the other ids."""
    vocab = {f"w{i}": i for i in range(VOCAB_SIZE) if i not in special.values()}
    vocab.update(special)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(special))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", model_max_length=4096, **tokens
    )


def _save_weights(
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    directory: Path,
    rename: Callable[[str], str] = lambda name: name,
) -> None:
    """The config and random weights (seeded: the same in every run) into ``directory``,
    each weight under ``rename(its name in the model)``."""
    config.initializer_range = INIT_STD
    torch.manual_seed(0)
    model = model_class(config)
    config.architectures = [model_class.__name__]
    config.save_pretrained(directory)
    weights = {rename(name): w.contiguous() for name, w in model.state_dict().items()}
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image> {% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)
"""LLaVA 1.5's chat format: a user message of an image and ``w17 w23`` renders as
``USER: <image> w17 w23 ASSISTANT:``."""


def write_llava(directory: Path) -> Path:
    """LLaVA 1.5 in miniature, saved into ``directory`` (returned)."""
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=LLAVA_IMAGE_SIZE,
            patch_size=14,
            projection_dim=64,
            initializer_range=INIT_STD,
        ),
        text_config=LlamaConfig(**_TINY_TEXT),
        image_token_index=LLAVA_SPECIAL["<image>"],
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    # transformers 5 builds the CLIP tower without the ``vision_model`` level that LLaVA
    # checkpoints on the hub have, and that vLLM's CLIP loads.
    _save_weights(
        LlavaForConditionalGeneration,
        config,
        directory,
        lambda name: name.replace("model.vision_tower.", "model.vision_tower.vision_model.", 1),
    )
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": LLAVA_IMAGE_SIZE},
        crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
    )
    tokenizer = _tokenizer(LLAVA_SPECIAL, bos_token="<s>", eos_token="</s>")
    LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    ).save_pretrained(directory)
    return directory


QWEN2_VL_PATCH = 14
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 448 * 448
"""An image of at most 448 x 448 pixels: up to 1024 patches of 2 x 14 x 14 RGB, 256 tokens
after the 2 x 2 merge."""


def write_qwen2_vl(directory: Path) -> Path:
    """Qwen2-VL in miniature, saved into ``directory`` (returned)."""
    config = Qwen2VLConfig(
        text_config={
            **_TINY_TEXT,
            "model_type": "qwen2_vl_text",
            "bos_token_id": QWEN2_VL_SPECIAL["<|endoftext|>"],
            "eos_token_id": QWEN2_VL_SPECIAL["<|im_end|>"],
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": _TINY_TEXT["hidden_size"],  # what the merger hands the text model
            "num_heads": 4,
            "mlp_ratio": 2,
            "patch_size": QWEN2_VL_PATCH,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
            "initializer_range": INIT_STD,
        },
        vision_start_token_id=QWEN2_VL_SPECIAL["<|vision_start|>"],
        vision_end_token_id=QWEN2_VL_SPECIAL["<|vision_end|>"],
        image_token_id=QWEN2_VL_SPECIAL["<|image_pad|>"],
        video_token_id=QWEN2_VL_SPECIAL["<|video_pad|>"],
    )
    _save_weights(Qwen2VLForConditionalGeneration, config, directory)
    pixels = {
        "size": {"shortest_edge": QWEN2_VL_MIN_PIXELS, "longest_edge": QWEN2_VL_MAX_PIXELS},
        "patch_size": QWEN2_VL_PATCH,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    tokenizer = _tokenizer(QWEN2_VL_SPECIAL, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixels),
        video_processor=Qwen2VLVideoProcessor(**pixels),
        tokenizer=tokenizer,
    ).save_pretrained(directory)
    return directory
