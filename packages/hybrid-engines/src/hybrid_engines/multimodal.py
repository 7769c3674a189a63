"""Images in a prompt, as each consumer takes them: the built-in engine and the trainer (pixel values, grid metadata and
the model's 3-D rotary positions, computed by one function so both sides feed the model the same thing), vLLM
(``multi_modal_data``) and SGLang (``image_data``).

A prompt's images travel as :class:`~hybrid_engines.protocol.MultimodalInput`: the encoded files (small; what vLLM and
SGLang decode and process themselves) and the grid the driver's processor gave each image (``image_grid_thw``); the
pixel values are made where the model runs, with the model folder's own image processor (:func:`with_pixels`), and
checked against that grid, so a processor that resizes differently is an error, not a silent mismatch. The prompt's
token ids already hold each image's placeholder tokens, expanded (``grid.prod() / merge_size**2`` of them).

Qwen2-VL and Qwen2.5-VL (M-RoPE: temporal, height and width positions) are the families handled; a model without a
vision tower given images is refused by name.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

from hybrid_core.errors import ConfigError

from .protocol import MultimodalInput


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config: Any) -> Any:
    """The transformers auto class that builds this config's generating model: image-text-to-text for a
    vision-language config (Qwen2-VL is not a ``AutoModelForCausalLM``), the causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


def load_image_processor(path: str, *, trust_remote_code: bool = False) -> Any:
    """The model folder's image processor (``preprocessor_config.json``): what turns an image into pixel values."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(
            "pretrain",
            f"{path!r} has no image processor ({type(e).__name__}: {e}), so it cannot take images.",
            "Use a vision-language model folder with its preprocessor_config.json, or drop the images.",
        ) from None


def decode_images(item: MultimodalInput) -> list[Any]:
    """The prompt's images as RGB PIL images (what the image processors, vLLM and SGLang take)."""
    from PIL import Image

    out = []
    for data in item.images:
        with Image.open(io.BytesIO(data)) as img:
            out.append(img.convert("RGB"))
    return out


def pixel_inputs(image_processor: Any, item: MultimodalInput) -> MultimodalInput:
    """``item`` with its pixel values (and the grid) from ``image_processor``; kept as it is when it has them.

    The grid must be the one the prompt's placeholder tokens were expanded for (``item.image_grid_thw``)."""
    if item.pixel_values is not None:
        return item
    out = image_processor(images=decode_images(item), return_tensors="pt")
    grid = out["image_grid_thw"].to(torch.long)
    if item.image_grid_thw is not None and not torch.equal(torch.as_tensor(item.image_grid_thw).to(grid), grid):
        raise ConfigError(
            "pretrain",
            f"the image processor here makes grids {grid.tolist()}, but the prompt's image tokens were counted for "
            f"{torch.as_tensor(item.image_grid_thw).tolist()} (another processor configuration).",
            "Give the engines and the trainer the same model folder the prompts were encoded with.",
        )
    return MultimodalInput(item.images, out["pixel_values"], grid)


def with_pixels(items: Sequence[MultimodalInput | None], image_processor: Any) -> list[MultimodalInput | None]:
    """:func:`pixel_inputs` of every item, each distinct item processed once (the ``n`` samples of a prompt share
    one)."""
    done: dict[int, MultimodalInput] = {}
    out: list[MultimodalInput | None] = []
    for item in items:
        if item is None or not item.images:
            out.append(None)
            continue
        if id(item) not in done:
            done[id(item)] = pixel_inputs(image_processor, item)
        out.append(done[id(item)])
    return out


def _rope_owner(model: Any) -> Any:
    """The module with ``get_rope_index`` (Qwen2-VL's inner model), or None for a model without M-RoPE."""
    for candidate in (model, getattr(model, "model", None), getattr(getattr(model, "base_model", None), "model", None)):
        if candidate is not None and callable(getattr(candidate, "get_rope_index", None)):
            return candidate
    return None


#: A forward argument of the trainer's scoring forward (``models.install_token_scores``): the input ids with image
#: tokens the *model generated* (in a response) replaced, so that only the prompt's placeholders take image features;
#: the model's own embeddings of the real ids go in as ``inputs_embeds`` (see :func:`apply_placeholder_ids`).
PLACEHOLDER_IDS = "hybrid_placeholder_ids"


def vision_forward_inputs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    items: Sequence[MultimodalInput | None] | None,
    *,
    prompt_len: int | None = None,
) -> dict[str, torch.Tensor]:
    """The extra forward arguments of a batch whose rows may hold images (``items[row]``, None: text only): the
    pixel values and grids of all rows' images in row order, and the 3-D rotary positions ``[3, B, T]`` of the
    whole batch (padding skipped). ``{}`` when no row has an image (the text path is unchanged).

    The built-in engine's prefill and the trainer's forward both call this, so the positions agree; decoding then
    continues from each row's largest position + 1 (text tokens carry one position in all three axes).
    ``prompt_len``: the columns before it are the prompts (the trainer's ``[prompt | response]`` rows); an image
    token a model generated after them is text, not a placeholder (:data:`PLACEHOLDER_IDS`)."""
    if not items or all(i is None or not i.images for i in items):
        return {}
    if len(items) != input_ids.shape[0]:
        raise ValueError(f"{len(items)} multimodal inputs for a batch of {input_ids.shape[0]} rows")
    owner = _rope_owner(model)
    config: Any = getattr(model, "config", None)
    if owner is None or not is_vision_config(config):
        raise ConfigError(
            "pretrain",
            f"the model ({type(model).__name__}) has no vision tower, but its prompts hold images.",
            "Use a vision-language model (Qwen2-VL / Qwen2.5-VL), or drop the images from the prompts.",
        )
    present = [i for i in items if i is not None and i.images]
    if any(i.pixel_values is None for i in present):
        raise ValueError("vision_forward_inputs: pixel values missing (call with_pixels first)")
    device = input_ids.device
    pixel_values = torch.cat([torch.as_tensor(i.pixel_values) for i in present]).to(device)
    grid = torch.cat([torch.as_tensor(i.image_grid_thw) for i in present]).to(device=device, dtype=torch.long)
    token_id = config.image_token_id
    is_image = input_ids == token_id
    generated = None
    if prompt_len is not None and bool(is_image[:, prompt_len:].any()):
        generated = is_image.clone()
        generated[:, :prompt_len] = False
        is_image = is_image & ~generated
    expected = int((grid.prod(-1) // (config.vision_config.spatial_merge_size**2)).sum())
    found = int(is_image.sum())
    if found != expected:
        raise ConfigError(
            "prompt_token_ids",
            f"the batch holds {found} image tokens, but its images' grids need {expected}.",
            "Encode each prompt with its images through the model's processor (placeholders expanded).",
        )
    kinds = is_image.to(torch.int32)
    positions, _ = owner.get_rope_index(
        input_ids, mm_token_type_ids=kinds, image_grid_thw=grid, attention_mask=attention_mask
    )
    out = {"pixel_values": pixel_values, "image_grid_thw": grid, "position_ids": positions}
    if generated is not None:
        pad = getattr(config.get_text_config(), "pad_token_id", None)
        out[PLACEHOLDER_IDS] = input_ids.masked_fill(generated, pad if isinstance(pad, int) and pad != token_id else 0)
    return out


def apply_placeholder_ids(model: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Inside a forward: with :data:`PLACEHOLDER_IDS`, the real ids' embeddings as ``inputs_embeds`` and the
    placeholder ids as ``input_ids`` (which the model reads only to find the prompt's image placeholders). Runs in
    the model's forward, so a sharded embedding is gathered by its own hooks."""
    ids = kwargs.pop(PLACEHOLDER_IDS, None)
    if ids is None:
        return kwargs
    kwargs["inputs_embeds"] = model.get_input_embeddings()(kwargs["input_ids"])
    kwargs["input_ids"] = ids
    return kwargs


def vllm_multimodal_data(item: MultimodalInput | None) -> dict[str, Any]:
    """The keys a vLLM ``TokensPrompt`` gets for a prompt's images (``{}`` for none)."""
    if item is None or not item.images:
        return {}
    return {"multi_modal_data": {"image": decode_images(item)}}


def sglang_image_data(item: MultimodalInput | None) -> list[Any] | None:
    """SGLang's ``image_data`` entry of one request: the prompt's images (None for none)."""
    if item is None or not item.images:
        return None
    return decode_images(item)


def check_multimodal(multimodal: Sequence[MultimodalInput | None] | None, prompts: int) -> None:
    """One entry (or None) per prompt, each a :class:`MultimodalInput`."""
    if multimodal is None:
        return
    if isinstance(multimodal, MultimodalInput) or len(multimodal) != prompts:
        raise ConfigError(
            "multimodal",
            f"expected one multimodal input (or None) per prompt, {prompts} in all.",
            "Pass a list as long as prompt_token_ids.",
        )
    for i, item in enumerate(multimodal):
        if item is not None and not isinstance(item, MultimodalInput):
            raise ConfigError("multimodal", f"entry {i} is a {type(item).__name__}, not a MultimodalInput.")
