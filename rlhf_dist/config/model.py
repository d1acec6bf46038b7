"""Sections of what is trained on what: the models and their loading (`model`), the data
files and their limits (`data`), and LoRA adapters (`lora`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_dist.config.keys import key
from rlhf_dist.errors import ConfigError, RewardFunctionError, UserError  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class ModelConfig:
    policy: str = key(
        "",
        "causal LM to start from (SFT input; PPO, DPO and KTO policy and reference): local dir "
        "or hub name",
    )
    reward: str = key(
        "",
        "sequence-classification reward model (RM output, PPO reward): local dir or hub name",
    )
    teacher: str = key(
        "",
        "on-policy distillation (docs/distill.md): the frozen causal LM that scores every token "
        "the policy samples (loaded and placed like the reference: model.frozen_dtype, "
        "distributed.frozen_models); it must share the policy's tokenizer; empty: none",
    )
    tokenizer: str = key("", "tokenizer path; empty means the policy's")
    dtype: str = key(
        "auto",
        "precision of the trained models (actor, critic; SFT/RM model): bfloat16 under "
        "DeepSpeed turns on its bf16 mixed precision (fp32 master weights in the optimizer), "
        "without it bf16 autocast over fp32 weights; auto = bfloat16 on a GPU that supports "
        "it, float32 on CPU (where bf16 matmuls are slow without AMX)",
        choices=("auto", "float32", "bfloat16"),
    )
    frozen_dtype: str = key(
        "auto",
        "weights of the frozen reference and reward model; auto = model.dtype",
        choices=("auto", "float32", "bfloat16"),
    )
    trust_remote_code: bool = key(
        False,
        "run Python code shipped with a hub model (its modeling files); off: only code we install",
    )
    safetensors_only: bool = key(
        True,
        "load weights from .safetensors only; false also allows pickle (.bin) checkpoints, "
        "which can run arbitrary code when loaded",
    )
    gradient_checkpointing: bool | None = key(
        None,
        "recompute each layer's activations in backward instead of keeping them (trained "
        "models: SFT/RM model, actor and critic; full, LoRA and ZeRO-3): activation memory "
        "of about one layer, for one extra forward per backward; null = on with a GPU (real "
        "models' activations are what runs out of memory), off on CPU",
    )
    attn_implementation: str = key(
        "auto",
        "attention kernel of every model (transformers' attn_implementation); auto keeps the "
        "model's default (sdpa for most); eager is faster for tiny models on CPU, where a fused "
        "kernel's setup costs more than the attention itself; flash_attention_2 needs the "
        "flash-attn package and a GPU",
        choices=("auto", "eager", "sdpa", "flash_attention_2"),
    )
    freeze_vision: bool = key(
        True,
        "a vision-language policy (docs/vision.md): its vision tower and projector are "
        "frozen, only the language model trains (as TRL, verl and OpenRLHF default); false "
        "trains them too. No effect on a text model",
    )
    router_aux_loss_coef: float | None = key(
        None,
        "mixture-of-experts models: weight of the load-balancing loss E x sum_i f_i P_i "
        "(Switch Transformer eq. 4, per MoE layer, averaged over layers) added to every "
        "training loss (SFT, DPO, KTO, the PPO/GRPO update), its expert token fractions f_i "
        "counted over the whole global batch (docs/moe.md); null = the model config's "
        "router_aux_loss_coef (0 if it has none); 0 = off; ignored for dense models",
        min=0.0,
    )
    moe_leaf_modules: tuple[str, ...] = key(
        (),
        "mixture-of-experts models under ZeRO-3: class names of the sparse blocks (router + "
        "experts) fetched as one unit, so that ranks whose tokens route to different experts "
        "never wait on each other's fetches (deepspeed set_z3_leaf_modules); empty = the "
        "blocks found in the model (a module with `experts` and a `gate` or `router`); a "
        "model whose config declares experts but has no block found needs this key",
    )


@dataclass(frozen=True)
class DataConfig:
    train: str = key(
        "",
        "training data: local .jsonl/.json/.parquet/.csv file, a hub dataset name, or "
        "reasoning_gym:TASK?size=N&seed=S&... (prompts and answers a reasoning-gym task "
        "generates; docs/grpo.md, Verifiable tasks)",
    )
    eval: str = key(
        "",
        "held-out data of the same format (each stage's held-out figures, at the end and every "
        "run.eval_every steps; PPO's and rlhf-dist eval's prompts); a reasoning-gym task here "
        "must use seeds data.train does not, and leaves out data.train's questions; empty: none",
    )
    split: str = key("train", "split of a hub dataset in data.train (local files are read whole)")
    eval_split: str = key("test", "split of a hub dataset in data.eval")
    subset: str = key(
        "",
        "configuration (subset) of a hub dataset in data.train / data.eval, as load_dataset's "
        "name: e.g. main for openai/gsm8k; empty: the dataset's only or default one",
    )
    prompt_field: str = key("prompt", "name of the prompt column")
    max_prompt_length: int = key(512, "prompt tokens kept (see data.too_long)", gt=0)
    max_image_tokens: int = key(
        0,
        "the memory planner (rlhf-dist plan, docs/vision.md): language-model tokens one image "
        "takes in a vision-language run; 0 = the family's count from config.json (LLaVA "
        "image_seq_length, Gemma 3 mm_tokens_per_image, one Idefics3 tile) or, for Qwen-VL, "
        "from the saved processor's max_pixels",
        min=0,
    )
    images_per_row: int = key(
        1,
        "the memory planner: images one prompt or conversation holds at most in a "
        "vision-language run (each runs through the vision tower in every forward)",
        min=0,
    )
    max_length: int = key(
        1024,
        "prompt + response tokens of SFT / RM / DPO / KTO sequences; longer rows are skipped "
        "or cut (data.truncate)",
        gt=0,
    )
    truncate: str = key(
        "none",
        "an SFT / RM / DPO / KTO sequence longer than data.max_length: none = skip it "
        "(counted); right = keep its first max_length tokens (the response loses its end and "
        "is trained without its EOS / end-of-turn); left = drop prompt tokens from the front, "
        "never the response (conversations: whole earlier turns); the two sequences of a pair "
        "are cut alike (docs/data.md)",
        choices=("none", "left", "right"),
    )
    too_long: str = key(
        "truncate",
        "a text prompt longer than data.max_prompt_length: keep its last tokens, or skip it "
        "(a conversational prompt is always skipped: cutting it would cut its template)",
        choices=("truncate", "drop"),
    )
    ptx: str = key(
        "",
        "PPO-ptx: SFT-format rows (the formats of data.train for SFT, docs/data.md) whose "
        "token-mean NLL, x ppo.ptx_coef, joins the actor's loss at every optimizer step; "
        "empty: none",
    )
    chat_template: str = key(
        "",
        "chat template for conversational rows (lists of {role, content} messages) of the "
        "policy's tokenizer: a Jinja string, the path of a file holding one, or chatml_tools "
        "(ChatML that shows tools and tool calls, for tokenizers whose own template ignores "
        "them, as SmolLM2's does); empty: the tokenizer's own (docs/data.md)",
    )


@dataclass(frozen=True)
class LoRAConfig:
    enabled: bool = key(
        False,
        "LoRA adapters (peft) on the trained policy (sft, dpo, kto, the PPO family's actor; "
        "not rm); the reference is the same base with adapters disabled, so the base "
        "weights are held once (LoRA dropout is always 0)",
    )
    r: int = key(16, "rank of the adapters", gt=0)
    alpha: int = key(32, "scale of the adapters (alpha / r)", gt=0)
    target_modules: tuple[str, ...] = key(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "names of the linear layers that get adapters",
    )
    critic: bool = key(
        False,
        "adapters on the critic too (its value head stays fully trainable); with the critic "
        "initialised from the reward model, the frozen reward model is that same base with "
        "adapters disabled: one copy of the reward model's weights",
        needs="critic",
    )
    load_in_4bit: bool = key(
        False,
        "QLoRA: load the LoRA base in 4-bit (bitsandbytes NF4, compute in model.dtype) with "
        "the adapters trained in fp32/bf16; the merged export is dequantized (docs/distributed.md, "
        "QLoRA). Needs lora.enabled, bitsandbytes, and no DeepSpeed",
    )
    experts: bool = key(
        False,
        "mixture-of-experts models: false = adapters on attention only (lora.target_modules "
        "minus the expert MLPs); true = on the experts too (fused 3-D experts through peft's "
        "target_parameters, module-list experts through their linears); the routers are never "
        "adapted (docs/moe.md)",
    )
    export: str = key(
        "both",
        "what final/ holds for a LoRA actor: the merged model, and/or the adapter in final_adapter/",
        choices=("merged", "adapter", "both"),
    )
