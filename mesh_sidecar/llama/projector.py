"""A multimodal projector (``--mmproj``): the vision encoder and projector that turn an image into
embeddings of the text model, published as ``mmproj-*.gguf`` beside a vision-language model
(Qwen2.5-VL, Qwen3-VL, Gemma 3, SmolVLM...).

llama-server loads it with the model (tools/mtmd) and answers chat requests with ``image_url``
parts. Checked here before anything starts: the file is a projector (``general.architecture``
``clip`` with a vision encoder) and, for the common projector types, projects to the text model's
embedding width (read from the tensor llama.cpp's ``clip_n_mmproj_embd`` reads: the key
``clip.vision.projection_dim`` is not it, older conversions wrote CLIP's own width there). mtmd
refuses a mismatch too, but only once llama-server loads, in its log.

The projector runs in the serving node's llama-server, on its CPU (``--no-mmproj-offload``): left
to llama.cpp, it would go to the first GPU-type device, which with ``--rpc`` is a worker's
rpc-server, where no plan counts it and every image would cross the network. So its memory is
the serving node's, like the model's input embeddings: its weights plus the compute buffer of one
image at the encoder's size (``memory_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from ..wire.gguf_header import GGUFHeader
from .model_files import read_header

ARCHITECTURE_KEY = "general.architecture"
PROJECTOR_ARCHITECTURE = "clip"
HAS_VISION_KEY = "clip.has_vision_encoder"
PROJECTOR_TYPE_KEY = "clip.projector_type"
VISION_PREFIX = "clip.vision."
# Where each projector type's output width is (clip_n_mmproj_embd in tools/mtmd/clip.cpp): a tensor and
# the dimension, in ggml order. qwen3vl's deepstack widens both sides alike, so its plain width compares.
# An "mlp" file with mm.3 tensors is loaded as mlp_norm. Other types: mtmd's own check at load.
WIDTH_TENSORS = {
    "mlp": (("mm.3.bias", 0), ("mm.2.weight", 1)),
    "mlp_norm": (("mm.3.bias", 0),),
    "idefics3": (("mm.model.fc.weight", 1),),
    "gemma3": (("mm.input_projection.weight", 0),),
    "qwen2vl_merger": (("mm.2.bias", 0),),
    "qwen2.5vl_merger": (("mm.2.bias", 0),),
    "qwen3vl_merger": (("mm.2.bias", 0),),
}
# The encoder's compute for one image at its size, f32: each block's widest live rows and its
# attention scores (heads x patches x patches), plus allocator slack.
ACTIVATION_BYTES = 4
LIVE_ROWS_PER_PATCH = 8  # residual, norm, q, k, v, attention out, and two feed-forward halves
COMPUTE_SLACK_BYTES = 4 * 1024 * 1024
_ENCODER_SHAPE = ("image_size", "patch_size", "embedding_length", "feed_forward_length", "attention.head_count")
UNKNOWN_COMPUTE_BYTES = 512 * 1024 * 1024  # an encoder of unknown shape: a large one's figure


@dataclass(frozen=True)
class Projector:
    """A checked projector file and what the plan needs of it."""

    path: Path
    projector_type: str  # clip.projector_type, e.g. "mlp", "idefics3", "qwen2.5vl_merger"
    width: int | None  # the width of the embeddings it makes (the text model's n_embd); None: not known here
    weight_bytes: int
    compute_bytes: int  # one image through the encoder, estimated from its hyperparameters
    sha256: str = ""  # its identity in gossip and receipts, once hashed (llama/model.py's model_sha256)

    @property
    def memory_bytes(self) -> int:
        """What it takes on the serving node."""
        return self.weight_bytes + self.compute_bytes


def read_projector(path: Path) -> Projector:
    """``path`` checked as a vision projector; ModelError saying what it is instead."""
    header = read_header(path)
    architecture = header.fields.get(ARCHITECTURE_KEY)
    if architecture != PROJECTOR_ARCHITECTURE:
        raise ModelError(f"{path} is not a multimodal projector (its {ARCHITECTURE_KEY} is {architecture!r}, not "
                         f"{PROJECTOR_ARCHITECTURE!r}): --mmproj takes the mmproj-*.gguf file published beside "
                         "the model; the model itself goes to --model.")
    if not header.fields.get(HAS_VISION_KEY):
        raise ModelError(f"{path} has no vision encoder (an audio-only projector?): --mmproj serves images.")
    projector_type = str(header.fields.get(PROJECTOR_TYPE_KEY, ""))
    return Projector(path, projector_type, _width(header, projector_type),
                     sum(t.n_bytes for t in header.tensors), _compute_bytes(header))


def check_pair(projector: Projector, model: Path, model_header: GGUFHeader) -> None:
    """ModelError unless ``projector`` makes embeddings as wide as ``model``'s (naming both widths)."""
    architecture = model_header.fields.get(ARCHITECTURE_KEY)
    n_embd = model_header.fields.get(f"{architecture}.embedding_length")
    if projector.width is not None and n_embd != projector.width:
        raise ModelError(f"{projector.path.name} makes {projector.width}-wide embeddings, but {model.name} "
                         f"takes {n_embd}-wide ones ({architecture}.embedding_length): they do not belong together. "
                         "Give the projector published with this model (mmproj-*.gguf in the same repository).")


def _width(header: GGUFHeader, projector_type: str) -> int | None:
    shapes = {tensor.name: tensor.shape for tensor in header.tensors}
    for name, dimension in WIDTH_TENSORS.get(projector_type, ()):
        if name in shapes and len(shapes[name]) > dimension:
            return shapes[name][dimension]
    return None


def _compute_bytes(header: GGUFHeader) -> int:
    """One image through the encoder; UNKNOWN_COMPUTE_BYTES for an encoder that does not say its shape."""
    shape: dict[str, int] = {}
    for name in _ENCODER_SHAPE:
        value = header.fields.get(VISION_PREFIX + name)
        if not isinstance(value, int) or value <= 0:
            return UNKNOWN_COMPUTE_BYTES
        shape[name] = value
    patches = (shape["image_size"] // shape["patch_size"]) ** 2
    rows = patches * (LIVE_ROWS_PER_PATCH * shape["embedding_length"] + shape["feed_forward_length"])
    scores = shape["attention.head_count"] * patches * patches
    return (rows + scores) * ACTIVATION_BYTES + COMPUTE_SLACK_BYTES
