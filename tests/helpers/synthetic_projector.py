"""A tiny multimodal projector ("mmproj") GGUF with random weights, and a tiny PNG to send it, for image-chat tests.

``llama-server --mmproj FILE`` loads a projector with llama.cpp's clip loader (tools/mtmd/clip.cpp), which turns an
image into embeddings the text model reads in place of token embeddings. This projector answers nonsense, but the
loader, the image preprocessing, the vision graph and the hand-over to the text model all run as with a real one.

Projector type ``mlp`` (LLaVA 1.5): the simplest the pinned loader supports. It needs no special tokens in the
text model's vocabulary (``init_vision`` adds no image-begin/end markers for it), preprocesses with a plain resize to
a fixed square (``mtmd_image_preprocessor_fixed_size``), runs a plain ViT (``clip_graph_llava``) and projects with
two matrices (``mm.0``, GELU, ``mm.2``). Every other type needs more tensors, merge factors or vocabulary tokens.

What the pinned loader needs (``clip_model_loader``, ``load_hparams`` and ``load_tensors``):

- ``clip.has_vision_encoder`` (bool), ``clip.projector_type`` (string, ``mlp``).
- u32 (read with ``gguf_get_val_u32``, so the type must be UINT32): ``clip.vision.embedding_length``,
  ``.attention.head_count``, ``.feed_forward_length``, ``.block_count``, ``.projection_dim``, ``.image_size``,
  ``.patch_size``; f32 ``clip.vision.attention.layer_norm_epsilon``; f32 arrays of 3 ``clip.vision.image_mean``
  and ``clip.vision.image_std``. ``general.architecture`` is ``clip`` by convention; the loader does not read it.
- Tensors: ``v.patch_embd.weight`` (a conv kernel), ``v.position_embd.weight`` (one row per patch), per block
  ``v.blk.N.attn_q/attn_k/attn_v/attn_out.weight``, ``ffn_up.weight``, ``ffn_down.weight`` (``ln1``/``ln2`` and all
  biases are optional, written here as a real CLIP has them), and ``mm.0.weight``, ``mm.0.bias``, ``mm.2.weight``,
  ``mm.2.bias``.

The projector's output width, which ``mtmd_context`` checks against the text model's ``llama_model_n_embd_inp``
(``n_embd`` for a llama model) and refuses to start on a mismatch, is for ``mlp`` the output dimension of
``mm.2.weight`` (``clip_n_mmproj_embd``: ``mm_2_w->ne[1]``). ``clip.vision.projection_dim`` is required but unused
by this type; it is written as the same width, as llama.cpp's converter does.

The LLaVA graph runs all blocks but the last (its features come from the second-to-last layer), so of the two
blocks written here one runs. ``feed_forward_length`` differs from ``embedding_length`` on purpose: the loader swaps
``ffn_up``/``ffn_down`` of LLaVA-era files whose ``ffn_down`` input width equals ``embedding_length``.
"""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path

import gguf
import numpy as np

PROJECTOR_TYPE = "mlp"
IMAGE_SIZE = 32  # pixels per side; images are resized to this square
PATCH_SIZE = 8  # (32 / 8)^2 = 16 patches, so an image takes 16 positions of the text model's context
VISION_EMBD = 64
VISION_HEADS = 4
VISION_FF = 256
VISION_BLOCKS = 2
PROJECTOR_HIDDEN = 128  # mm.0's output width, mm.2's input
LAYER_NORM_EPS = 1e-6
WEIGHT_STD = 0.02  # small enough that activations stay finite, large enough that the image changes the answer
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


def write_projector(path: Path, text_embd: int, *, seed: int = 0) -> Path:
    """Writes a ``mlp`` projector to ``path`` whose output width (``mm.2.weight``'s output dimension) is
    ``text_embd``, the text model's embedding width; f32 random weights drawn from ``seed``. Returns ``path``."""
    if text_embd <= 0:
        raise ValueError("text_embd must be positive")
    rng = np.random.default_rng(seed)

    def random(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    n_patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name("synthetic-projector")
    writer.add_description(f"random-weight {PROJECTOR_TYPE} projector for tests, output width {text_embd}")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", PROJECTOR_TYPE)
    for key, value in (
        ("image_size", IMAGE_SIZE),
        ("patch_size", PATCH_SIZE),
        ("embedding_length", VISION_EMBD),
        ("feed_forward_length", VISION_FF),
        ("block_count", VISION_BLOCKS),
        ("attention.head_count", VISION_HEADS),
        ("projection_dim", text_embd),
    ):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", LAYER_NORM_EPS)
    writer.add_array("clip.vision.image_mean", list(IMAGE_MEAN))
    writer.add_array("clip.vision.image_std", list(IMAGE_STD))

    # numpy shapes are ggml's ne reversed: a matrix mapping n_in to n_out is (n_out, n_in).
    writer.add_tensor("v.patch_embd.weight", random(VISION_EMBD, 3, PATCH_SIZE, PATCH_SIZE))
    writer.add_tensor("v.position_embd.weight", random(n_patches, VISION_EMBD))
    for block in range(VISION_BLOCKS):
        prefix = f"v.blk.{block}"
        for norm in ("ln1", "ln2"):
            writer.add_tensor(f"{prefix}.{norm}.weight", ones(VISION_EMBD))
            writer.add_tensor(f"{prefix}.{norm}.bias", zeros(VISION_EMBD))
        for attn in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{prefix}.{attn}.weight", random(VISION_EMBD, VISION_EMBD))
            writer.add_tensor(f"{prefix}.{attn}.bias", zeros(VISION_EMBD))
        writer.add_tensor(f"{prefix}.ffn_up.weight", random(VISION_FF, VISION_EMBD))
        writer.add_tensor(f"{prefix}.ffn_up.bias", zeros(VISION_FF))
        writer.add_tensor(f"{prefix}.ffn_down.weight", random(VISION_EMBD, VISION_FF))
        writer.add_tensor(f"{prefix}.ffn_down.bias", zeros(VISION_EMBD))
    writer.add_tensor("mm.0.weight", random(PROJECTOR_HIDDEN, VISION_EMBD))
    writer.add_tensor("mm.0.bias", zeros(PROJECTOR_HIDDEN))
    writer.add_tensor("mm.2.weight", random(text_embd, PROJECTOR_HIDDEN))
    writer.add_tensor("mm.2.bias", zeros(text_embd))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_png(width: int = 16, height: int = 16) -> bytes:
    """An RGB PNG of ``width`` x ``height`` pixels (a red/green gradient over blue), made with the stdlib."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    def level(i: int, n: int) -> int:
        return i * 255 // max(n - 1, 1)

    pixels = bytearray()
    for y in range(height):
        pixels.append(0)  # filter type of the scanline: none
        for x in range(width):
            pixels += bytes((level(x, width), level(y, height), 128))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(pixels))) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


TINY_PNG = tiny_png()
TINY_PNG_DATA_URL = "data:image/png;base64," + base64.b64encode(TINY_PNG).decode("ascii")


def image_chat_messages(text: str = "What is in this image?", url: str = TINY_PNG_DATA_URL) -> list[dict[str, object]]:
    """OpenAI-style chat messages with one user turn of ``text`` and an image (by default ``TINY_PNG``)."""
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": content}]
