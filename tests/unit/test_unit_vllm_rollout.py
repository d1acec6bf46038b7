"""The vLLM rollout backend's pieces that need no engine: request building, the sampling
parameters (checked against vLLM's own SamplingParams when vllm is installed), output
parsing, weight naming for vLLM's loader (plain and LoRA), per-request seeds, config rules
and the demo's overrides."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rlhf_dist.config import ConfigError, GenerationConfig, config_from_dict, validate
from rlhf_dist.generation.vllm import (
    hf_weights,
    import_vllm,
    prompts_for_engine,
    responses_from_outputs,
    sampling_params,
    sampling_seeds,
)


def test_prompts_for_engine_drops_left_padding():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 11]])
    mask = (ids != 0).long()
    assert prompts_for_engine(ids, mask) == [
        {"prompt_token_ids": [5, 6]},
        {"prompt_token_ids": [7, 8, 9, 10]},
        {"prompt_token_ids": [11]},
    ]


def _completion(tokens, logprobs):
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs)]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=steps)])


def test_responses_from_outputs_pads_and_keeps_sampled_logprobs():
    outs = [_completion([4, 2], [-0.5, -1.5]), _completion([9, 9, 9], [-1.0, -2.0, -3.0])]
    ids, lp = responses_from_outputs(outs, pad_id=0)
    assert ids.tolist() == [[4, 2, 0], [9, 9, 9]]
    assert lp.tolist() == [[-0.5, -1.5, 0.0], [-1.0, -2.0, -3.0]]
    assert ids.dtype == torch.long and lp.dtype == torch.float32


def test_responses_from_outputs_all_empty_keeps_one_column():
    ids, lp = responses_from_outputs([_completion([], [])], pad_id=3)
    assert ids.tolist() == [[3]] and lp.tolist() == [[0.0]]


def _recorder():
    return SimpleNamespace(SamplingParams=lambda **kw: kw)


def test_sampling_params_carry_every_generation_key():
    gen = GenerationConfig(max_new_tokens=20, min_new_tokens=3, temperature=0.7, top_k=5, top_p=0.9)
    kw = sampling_params(_recorder(), gen, (2, 7), seed=11)
    assert kw == {
        "n": 1,
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 0.9,
        "max_tokens": 20,
        "min_tokens": 3,
        "stop_token_ids": [2, 7],
        "ignore_eos": True,  # a vision engine's tokenizer EOS: only stop_ids stop
        "logprobs": 0,
        "detokenize": False,
        "seed": 11,
    }


def test_sampling_params_accepted_by_vllm():
    vllm = pytest.importorskip("vllm")
    gen = GenerationConfig(max_new_tokens=9, min_new_tokens=2, temperature=0.5, top_k=0, top_p=1.0)
    sp = sampling_params(vllm, gen, (2,), seed=1)
    assert (sp.max_tokens, sp.min_tokens, sp.temperature) == (9, 2, 0.5)
    assert sp.top_k in (0, -1) and sp.top_p == 1.0  # both mean "off" in vLLM
    assert list(sp.stop_token_ids) == [2] and sp.seed == 1 and sp.logprobs == 0


def test_sampling_seeds_distinct_and_follow_torch_rng():
    torch.manual_seed(3)
    a = sampling_seeds(64)
    torch.manual_seed(3)
    b = sampling_seeds(64)
    assert torch.equal(a, b)  # a resumed run (RNG restored) draws the same seeds
    assert a.unique().numel() == 64  # copies of one prompt must not share a seed


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_hf_weights_of_a_plain_model_are_its_state_dict():
    model = _tiny_llama()
    names = dict(hf_weights(model))
    assert set(names) == {n for n, _ in model.named_parameters()}


def test_hf_weights_of_lora_model_are_merged_base_under_checkpoint_names():
    from peft import LoraConfig, get_peft_model

    from rlhf_dist.models.lora import merged_adapters

    model = _tiny_llama()
    plain_names = {n for n, _ in model.named_parameters()}
    lora = LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(model, lora)
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    expected = q.base_layer.weight + q.get_delta_weight("default")
    with merged_adapters(peft_model) as merged:
        weights = dict(hf_weights(merged))
        assert set(weights) == plain_names  # no lora_A/B, no base_layer
        torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], expected)


def test_missing_vllm_is_a_config_error_naming_the_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ConfigError, match=r"^generation.backend=vllm: the vllm package"):
        import_vllm()


def _ppo_tree(**sections):
    tree = {"model": {"policy": "p", "reward": "r"}, "data": {"train": "t.jsonl"}}
    for name, values in sections.items():
        tree[name] = values
    return tree


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"ppo": {"tis_cap": 2.0}}, r"^ppo.rollout_correction: needs generation.backend=vllm"),
        (
            {"ppo": {"tis_cap": 0.0}, "generation": {"backend": "vllm"}},
            r"^ppo.tis_cap: must be > 0",
        ),
        (
            {"generation": {"backend": "vllm"}, "perf": {"gather_for_generation": False}},
            r"^generation.backend=vllm: needs perf.gather_for_generation=true",
        ),
        (
            {"generation": {"vllm_gpu_memory_utilization": 1.5}},
            r"^generation.vllm_gpu_memory_utilization: must be in",
        ),
        ({"generation": {"backend": "sglang"}}, r"^generation.backend: must be one of hf, vllm"),
    ],
)
def test_vllm_config_errors_name_the_key(sections, message):
    with pytest.raises(ConfigError, match=message):
        validate(config_from_dict(_ppo_tree(**sections)), "ppo")


def test_vllm_config_accepted():
    tree = _ppo_tree(generation={"backend": "vllm"}, ppo={"tis_cap": 2.0})
    cfg = config_from_dict(tree)
    validate(cfg, "ppo")
    assert cfg.generation.backend == "vllm"
    # the old key ppo.tis_cap: C is truncated IS at the token level with cap C
    assert (cfg.ppo.rollout_correction, cfg.ppo.rollout_correction_level) == ("tis", "token")
    assert cfg.ppo.rollout_correction_high == 2.0
    # accepted because the backend is vllm: with hf the same key is refused.
    with pytest.raises(ConfigError, match=r"^ppo.rollout_correction: needs generation.backend"):
        validate(config_from_dict(_ppo_tree(ppo={"tis_cap": 2.0})), "ppo")


def test_demo_overrides_reach_every_stage_and_owned_keys_are_refused():
    from rlhf_dist.demo.pipeline import with_overrides

    trees = {"sft": {"run": {"output_dir": "a"}}, "ppo": {"generation": {"max_new_tokens": 4}}}
    out = with_overrides(trees, ["generation.backend=vllm", "model.dtype=bfloat16"])
    assert out["ppo"]["generation"] == {"max_new_tokens": 4, "backend": "vllm"}
    assert out["sft"]["generation"] == {"backend": "vllm"}
    assert out["sft"]["model"]["dtype"] == "bfloat16" and out["sft"]["run"] == {"output_dir": "a"}
    assert trees["ppo"]["generation"] == {"max_new_tokens": 4}  # inputs left alone
    with pytest.raises(ConfigError, match=r"^model.policy: the demo sets it"):
        with_overrides(trees, ["model.policy=x"])


def test_importing_the_backend_does_not_import_vllm():
    # hf-backend users need not install vllm: the module imports it only when asked.
    code = "import rlhf_dist.generation.vllm, sys; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
