"""The memory plan's vision terms against a measured peak (docs/vision.md "Memory plan"):
one SFT step of a tiny LLaVA whose CLIP tower (4 layers of width 128, 65 positions an
image) outweighs its language model's activations, fp32 on CPU, measured by the
profiler's allocation records as launch/bench/memory.py plan measures. With the tower
trained, the planned update peak is within 15% of the measured one, as for text cells
(test_integration_plan_measured.py)."""

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "launch/bench"
VOCAB, ROWS, LENGTH, IMAGE, PATCH = 512, 8, 96, 64, 8


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from rlhf_dist.demo.task import tiny_llama_config

    vision = CLIPVisionConfig(
        hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        image_size=IMAGE, patch_size=PATCH, projection_dim=64,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=tiny_llama_config(VOCAB, 0, 1, 1), image_token_id=5,
        vision_feature_select_strategy="default", vision_feature_layer=-1,
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("llava_measured") / "model"
    LlavaForConditionalGeneration(config).save_pretrained(str(out))
    return out


def measured_update(path: Path, frozen: bool, checkpointing: bool) -> int:
    """Bytes held at the peak of one fp32 SFT-like step over ROWS sequences of LENGTH
    tokens, each with one image (its 64 tokens after 2 text tokens): weights, optimizer
    states and the step's peak allocations."""
    from memory import held_bytes, peak_during
    from transformers import LlavaForConditionalGeneration

    from rlhf_dist.config import OptimConfig, PerfConfig
    from rlhf_dist.engine.forward import token_logprobs
    from rlhf_dist.models.loading import disable_dropout, enable_gradient_checkpointing
    from rlhf_dist.models.vision import freeze_vision
    from rlhf_dist.trainers.common import make_optimizer

    model = disable_dropout(LlavaForConditionalGeneration.from_pretrained(str(path)))
    model = freeze_vision(model) if frozen else model
    model = enable_gradient_checkpointing(model) if checkpointing else model
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer([(trained, OptimConfig())])
    g = torch.Generator().manual_seed(0)
    tokens = (IMAGE // PATCH) ** 2
    ids = torch.randint(6, VOCAB, (ROWS, LENGTH), generator=g)
    ids[:, 2 : 2 + tokens] = 5
    predict = torch.ones(ROWS, LENGTH - 3 - tokens, dtype=torch.bool)
    media = {"pixel_values": torch.randn(ROWS, 3, IMAGE, IMAGE, generator=g)}
    perf = PerfConfig(packed_linears=False)

    def step() -> None:
        model.train()
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids), predict, perf=perf, media=media)
        (-(lp * predict).sum() / predict.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # Adam's moments exist from here
    return held_bytes(model, optimizer) + peak_during(step)[0]


def planned_update(path: Path, frozen: bool, checkpointing: bool) -> float:
    from rlhf_dist.config import load_config
    from rlhf_dist.planning import GIB, Hardware, build_plan, read_shapes

    cfg = load_config(None, [
        f"model.policy={path}", "model.dtype=float32", f"model.freeze_vision={frozen}",
        f"model.gradient_checkpointing={checkpointing}", f"data.max_length={LENGTH}",
        f"sft.batch_size={ROWS}", f"sft.micro_batch_size={ROWS}",
    ])  # fmt: skip
    plan = build_plan(cfg, "sft", read_shapes(cfg, "sft"), Hardware(1, 1024 * GIB, device="cpu"))
    return plan.phases[-1].total


def test_planned_update_is_within_15_percent_of_the_measured_peak(llava, monkeypatch):
    # the trained tower without checkpointing, where its terms weigh most (its kept
    # activations are 16 of the 42 MiB planned); the frozen and checkpointed cells were
    # measured once (docs/vision.md) and left out for the suite's time
    monkeypatch.syspath_prepend(str(BENCH))
    planned = planned_update(llava, frozen=False, checkpointing=False)
    measured = measured_update(llava, frozen=False, checkpointing=False)
    assert planned == pytest.approx(measured, rel=0.15)
    sys.modules.pop("memory", None)
