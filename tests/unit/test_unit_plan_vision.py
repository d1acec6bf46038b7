"""The memory planner's vision terms (rlhf_dist/planning, docs/vision.md "Memory plan"): a
vision tower and projector read from config.json, counted by hand and checked against the
parameters transformers builds for six families, its activations by hand, and what
model.freeze_vision changes in the plan."""

import dataclasses
import json

import pytest

from rlhf_dist.config import Config, DataConfig, ModelConfig, sizes
from rlhf_dist.errors import ConfigError
from rlhf_dist.planning import GIB, Hardware, ModelShape, Shapes, build_plan
from rlhf_dist.planning import memory as mem
from rlhf_dist.planning.shapes import vision_shape

POLICY = ModelShape(
    vocab=100, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128
)
TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, vocab_size=300,
)  # fmt: skip
VIT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    image_size=16, patch_size=8,
)  # fmt: skip
QWEN_VIT = dict(hidden_size=32, intermediate_size=64, depth=2, num_heads=2, patch_size=8)
FAMILIES = {
    "llava": dict(vision_config=dict(VIT, model_type="clip_vision_model")),
    "qwen2_vl": dict(
        vision_config=dict(
            embed_dim=32, mlp_ratio=2, depth=2, num_heads=2, patch_size=8, hidden_size=64
        )
    ),  # fmt: skip
    "qwen2_5_vl": dict(vision_config=dict(QWEN_VIT, out_hidden_size=64)),
    "qwen3_vl": dict(
        vision_config=dict(
            QWEN_VIT, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0]
        )
    ),  # fmt: skip
    "idefics3": dict(vision_config=VIT, scale_factor=2),
    "gemma3": dict(vision_config=VIT, mm_tokens_per_image=4),
}


def config_of(family: str):  # -> transformers.PretrainedConfig
    from transformers import AutoConfig

    return AutoConfig.for_model(family, text_config=TEXT, **FAMILIES[family])


def test_llava_with_a_clip_tower_by_hand():
    v = vision_shape(config_of("llava"), "tiny")
    # patch conv 3 x 8 x 8 -> 32, no bias: 6144; one layer: q, k, v, o with biases
    # 4 x 32^2 + 4 x 32 = 4224, fc1 / fc2 2 x 32 x 64 + 64 + 32 = 4192, two LayerNorms 128;
    # 4 patches + CLS positions and the class embedding (5 + 1) x 32 = 192; pre and post
    # LayerNorms 128; projector 32 x 64 + 64 + 64 x 64 + 64 = 6272
    assert v.params == 6144 + 4224 + 4192 + 128 + 192 + 128 + 6272
    assert (v.image_tokens, v.positions) == (4, 5)  # the default strategy drops CLS


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vision_parameters_equal_what_transformers_builds(family):
    from transformers import AutoModelForImageTextToText

    from rlhf_dist.models.vision import is_vision_part

    config = config_of(family)
    model = AutoModelForImageTextToText.from_config(config)
    built = sum(p.numel() for n, p in model.named_parameters() if is_vision_part(n))
    assert vision_shape(config, "tiny", max_image_tokens=16).params == built


def test_image_tokens_of_each_family(tmp_path):
    assert vision_shape(config_of("gemma3"), "x").image_tokens == 4  # mm_tokens_per_image
    idefics = vision_shape(config_of("idefics3"), "x")  # one tile: 4 patches / 2^2
    assert (idefics.image_tokens, idefics.positions) == (1, 4)
    qwen = vision_shape(config_of("qwen2_vl"), "x", max_image_tokens=10)
    assert (qwen.image_tokens, qwen.positions) == (10, 40)  # 2 x 2 patches per token
    saved = {"image_processor": {"size": {"longest_edge": 64 * 64}}}
    (tmp_path / "processor_config.json").write_text(json.dumps(saved))
    # the processor's max_pixels over the (8 x 2)^2 pixels of one merged token
    assert vision_shape(config_of("qwen2_vl"), str(tmp_path)).image_tokens == 16
    with pytest.raises(ConfigError, match=r"^data\.max_image_tokens: "):
        vision_shape(config_of("qwen2_vl"), str(tmp_path / "none"))


def test_vision_activations_by_hand():
    v = mem.VisionShape(params=0, hidden=32, layers=2, heads=2, intermediate=64, image_tokens=4, positions=5)  # fmt: skip
    n = 3 * 5  # 3 images of 5 positions
    # frozen: one layer's forward, 5h + 2f per position
    assert mem.vision_activations(v, 3, 4.0, "fused", False, False) == n * (160 + 128) * 4
    # trained: 8h + 2f + a per position per layer (fused), 2 layers
    assert mem.vision_layer_elements(v, "fused") == 256 + 128 + 2
    assert mem.vision_activations(v, 3, 4.0, "fused", True, False) == n * 2 * 386 * 4
    # checkpointed: each layer's input plus the layer backward recomputes
    assert mem.vision_activations(v, 3, 4.0, "fused", True, True) == n * (2 * 32 + 386) * 4
    eager = dataclasses.replace(v, gated=True)  # SwiGLU: 3f
    assert mem.vision_layer_elements(eager, "eager") == 256 + 192 + 2 * 5


def terms(shapes: Shapes, freeze: bool, stage: str = "sft") -> dict[str, float]:
    cfg = Config(
        model=ModelConfig(policy="x", dtype="float32", freeze_vision=freeze),
        data=DataConfig(max_length=64, images_per_row=2),
    )
    plan = build_plan(cfg, stage, shapes, Hardware(1, 80 * GIB, device="cpu"))
    return {name: b for phase in plan.phases for name, b in phase.terms}


def test_freeze_vision_keeps_weights_only_and_trained_adds_states_and_activations():
    v = mem.VisionShape(params=1000, hidden=32, layers=2, heads=2, intermediate=64, image_tokens=4, positions=500)  # fmt: skip
    text, frozen = terms(Shapes(POLICY), True), terms(Shapes(POLICY, vision=v), True)
    trained = terms(Shapes(POLICY, vision=v), False)
    # frozen: its fp32 weights, no gradients or Adam moments
    assert frozen["weights"] - text["weights"] == 4 * 1000
    assert frozen["optimizer states"] == text["optimizer states"]
    assert frozen["gradients"] == text["gradients"]
    # trained: fp32 gradients and two moments, and its kept activations
    assert trained["optimizer states"] - text["optimizer states"] == 8 * 1000
    assert trained["gradients"] - text["gradients"] == 4 * 1000
    sft = Config().sft
    rows = sizes.micro_batch_size(sft.micro_batch_size, sft.batch_size, 1)  # 2 images each
    kept = mem.vision_activations(v, rows * 2, 4.0, "fused", True, False)
    assert trained["vision tower activations"] == kept > 0
    # a frozen tower's forward counts by what it exceeds of the rest of the micro-batch
    assert frozen["vision tower forward (frozen)"] >= 0
    assert "vision tower activations" not in frozen


def test_the_reference_and_the_prefill_hold_the_vision_tower():
    v = mem.VisionShape(params=1000, hidden=32, layers=2, heads=2, intermediate=64, image_tokens=4, positions=5000)  # fmt: skip
    text, vision = terms(Shapes(POLICY), True, "ppo"), terms(Shapes(POLICY, vision=v), True, "ppo")
    assert vision["reference"] - text["reference"] == 4 * 1000  # the same class, frozen fp32
    # the decode loop's prefill runs the prompts' images through the tower first: here
    # the tower's forward (5000 positions an image) is the larger
    assert vision["prefill"] > text["prefill"]
