"""Run configuration: frozen dataclasses, one per section, from YAML plus `a.b=c` overrides.

Every mistake a user can make in a config (unknown key, wrong type, a value outside its
choices or range, an impossible combination) raises `ConfigError` with a one-line message naming
the key, before any model is loaded. Config objects are never written to at run time;
numbers derived from them (per-rank batch sizes, accumulation steps) live in
`rlhf_dist.batching`.

Each key is declared once, with `key(default, help, choices=..., min=/max=/gt=/lt=)`: its
meaning and its range live there and nowhere else (`validate` checks them, then only the
rules between keys), `rlhf-dist config [SECTION]` prints it (`describe`), and a unit test fails
for a key without help. A new key is one such line in its section's dataclass.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlhf_dist.errors import ConfigError, RewardFunctionError, UserError  # noqa: F401 (re-exported)
from rlhf_dist.files import atomic_write_text
from rlhf_dist.names import (
    ESTIMATORS,
    KL_KINDS,
    LOSS_AGGREGATIONS,
    OVERLONG,
    POLICY_LOSSES,
    RATIO_LEVELS,
)

BOUNDS = ("min", "max", "gt", "lt")  # >= min, <= max, > gt, < lt


def key(
    default: Any,
    help: str,
    choices: tuple[str, ...] = (),
    *,
    finite: bool = False,
    **bounds: float,
) -> Any:
    """A config key: its default, its meaning (what `rlhf-dist config` prints), and what
    `validate` enforces on its value: `choices` for text keys (and each item of a list
    key) with a fixed set of values; a range, `min`/`max` (inclusive) and `gt`/`lt`
    (exclusive), on numbers (and each item of a list key; null passes where the key is
    optional); `finite` alone refuses NaN and inf (any bound implies it). Every key is
    declared with this, so its documentation and range cannot drift away from it."""
    unknown = set(bounds) - set(BOUNDS)
    if unknown:
        raise TypeError(f"key(): unknown bound {sorted(unknown)} (one of {BOUNDS})")
    meta: dict[str, Any] = {"help": help}
    if choices:
        meta["choices"] = tuple(choices)
    if bounds or finite:
        meta["range"] = dict(bounds)
    return field(default=default, metadata=meta)


def range_text(bounds: dict[str, float]) -> str:
    """`{"gt": 0}` -> "> 0", `{"min": 0, "max": 1}` -> "in [0, 1]", `{}` -> "finite"."""
    low = ("[", bounds["min"]) if "min" in bounds else ("(", bounds.get("gt"))
    high = ("]", bounds["max"]) if "max" in bounds else (")", bounds.get("lt"))
    if low[1] is not None and high[1] is not None:
        return f"in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low[1] is not None:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"
    if high[1] is not None:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]:g}"
    return "finite"


def in_range(value: float, bounds: dict[str, float]) -> bool:
    """Whether `value` is finite and within `bounds` (key's min/max/gt/lt); NaN never is."""
    if not math.isfinite(value):
        return False
    return not (
        ("min" in bounds and value < bounds["min"])
        or ("max" in bounds and value > bounds["max"])
        or ("gt" in bounds and value <= bounds["gt"])
        or ("lt" in bounds and value >= bounds["lt"])
    )


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = key("runs/default", "where the run writes metrics, checkpoints and final/")
    seed: int = key(0, "seed of every RNG (each rank derives its own from it)")
    log_every: int = key(1, "write a metrics row every N steps (SFT/RM) or iterations (PPO)", gt=0)
    trackers: tuple[str, ...] = key(
        (),
        "trackers besides metrics.jsonl (always written): wandb, tensorboard",
        choices=("wandb", "tensorboard"),
    )
    project: str = key("rlhf_dist", "project name in the trackers")
    wandb_mode: str = key("online", "W&B mode", choices=("online", "offline"))
    histogram_every: int = key(
        10,
        "PPO: histograms (advantages, per-token KL, scores, lengths) every N iterations; 0 = never",
        min=0,
    )
    samples_every: int = key(
        10, "PPO: a table of sampled responses every N iterations; 0 = never", min=0
    )
    num_samples: int = key(8, "responses in each sample table", gt=0)
    progress: bool = key(
        True, "a progress bar with ETA on the main process (when stderr is a terminal)"
    )
    checkpoint_every: int = key(
        0,
        "save a resumable checkpoint every N optimizer steps (SFT/RM) or iterations (PPO); "
        "0 = never (a SIGTERM still writes one)",
        min=0,
    )
    keep_checkpoints: int = key(2, "how many of the newest checkpoints are kept", min=1)
    resume: str = key(
        "",
        "auto: continue from <output_dir>/checkpoints/latest if there is one; or a checkpoint path",
    )
    max_bad_steps: int = key(
        3,
        "optimizer steps with a non-finite loss or gradient are skipped (all ranks agree); this "
        "many in a row stop the run with a checkpoint of the last good state",
        gt=0,
    )
    num_threads: int = key(
        0,
        "CPU threads per process; 0 = the machine's cores divided among the local ranks "
        "(oversubscribed OpenMP threads spin-wait and run 10-100x slower)",
        min=0,
    )
    retain_host_memory: bool = key(
        True,
        "CPU runs: keep freed host memory in the process for the next tensor (glibc malloc: "
        "no mmap, no trim) instead of handing every large block back to the OS, whose fresh "
        "pages then fault in one by one: a SmolLM2 GRPO update ~4.0 -> ~3.4 s and its minor "
        "page faults ~200k -> ~0; the resident size stays at the run's peak (the "
        "151,936-vocabulary probe 1.53 -> 1.56 GiB; docs/benchmarks.md). false: glibc's "
        "defaults",
    )


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
    tokenizer: str = key("", "tokenizer path; empty means the policy's")
    dtype: str = key(
        "float32",
        "weights of the trained models (actor, critic; SFT/RM model); bfloat16 under DeepSpeed "
        "turns on its bf16 mixed precision (fp32 master weights in the optimizer)",
        choices=("float32", "bfloat16"),
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
    gradient_checkpointing: bool = key(
        False,
        "recompute each layer's activations in backward instead of keeping them (trained "
        "models: SFT/RM model, actor and critic; full, LoRA and ZeRO-3): activation memory "
        "of about one layer, for one extra forward per backward",
    )
    attn_implementation: str = key(
        "auto",
        "attention kernel of every model (transformers' attn_implementation); auto keeps the "
        "model's default (sdpa for most); eager is faster for tiny models on CPU, where a fused "
        "kernel's setup costs more than the attention itself; flash_attention_2 needs the "
        "flash-attn package and a GPU",
        choices=("auto", "eager", "sdpa", "flash_attention_2"),
    )
    logprob_chunk_tokens: int = key(
        512,
        "tokens whose vocabulary-wide logits are computed at once when log-probs and "
        "entropies are taken (rollout scoring, the PPO update, SFT, DPO/KTO, eval): the "
        "full (tokens, vocabulary) logits never exist, the extra memory is a few "
        "(logprob_chunk_tokens, vocabulary) fp32 tensors",
        gt=0,
    )
    packed_sequences: bool = key(
        False,
        "padding-free whole-sequence forwards: each forward's rows (log-probs in rollout "
        "scoring, the PPO update, SFT, DPO/KTO and eval; critic, reward-model and RM "
        "training values) have their real tokens packed into rows no longer than the padded "
        "ones (first-fit decreasing; flash_attention_2: one row), position ids restarting "
        "per sequence, and the outputs mapped back: no compute on padding. Exact (equal to "
        "float rounding) for models whose masks come from transformers' masking_utils "
        "(Llama, Qwen, Mistral, Gemma, GPT-2; others are refused at load): eager/sdpa get a "
        "block-diagonal causal mask (on CPU it can cost what the padding did), "
        "flash_attention_2 its varlen kernels. Generation is never packed",
    )
    shared_prompt_forward: bool = key(
        True,
        "rollout forwards run each distinct prompt once: generation's prefill, rollout "
        "scoring (actor and reference log-probs) and the PPO update's actor forward run "
        "the prompts, deduplicated, with a KV cache that is then indexed out to every row "
        "of the prompt's group, and the responses on it; with samples_per_prompt = n the "
        "prompt tokens cost 1/n of the FLOPs. Equal to float rounding; gradients of a "
        "shared prompt sum over its group. Off under gradient checkpointing (no KV cache "
        "there), for the forwards packed_sequences packs (packing already drops the "
        "padding; generation's prefill still shares) and in the ZeRO-3 update (scoring "
        "and generation there still share)",
    )


@dataclass(frozen=True)
class DataConfig:
    train: str = key(
        "", "training data: local .jsonl/.json/.parquet/.csv file, or a hub dataset name"
    )
    eval: str = key(
        "", "held-out data of the same format (RM and DPO accuracy, eval prompts); empty: none"
    )
    split: str = key("train", "split of a hub dataset (local files are read whole)")
    prompt_field: str = key("prompt", "name of the prompt column")
    max_prompt_length: int = key(64, "prompt tokens kept (see data.too_long)", gt=0)
    max_length: int = key(
        128,
        "prompt + response tokens of SFT / RM / DPO / KTO sequences; longer rows are skipped",
        gt=0,
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
        "policy's tokenizer: a Jinja string or the path of a file holding one; empty: the "
        "tokenizer's own (docs/data.md)",
    )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = key(1e-4, "peak learning rate of AdamW", gt=0)
    weight_decay: float = key(0.0, "AdamW weight decay")
    adam_eps: float = key(1e-5, "AdamW epsilon", gt=0)
    max_grad_norm: float = key(1.0, "gradients are clipped to this global L2 norm", gt=0)
    warmup_steps: int = key(0, "optimizer steps of linear warmup up to lr", min=0)
    schedule: str = key(
        "constant",
        "learning rate after warmup: constant, or decaying to 0 by the last optimizer step",
        choices=("constant", "linear", "cosine"),
    )


@dataclass(frozen=True)
class SFTConfig:
    epochs: int = key(1, "passes over data.train", gt=0)
    batch_size: int = key(32, "sequences per optimizer step, summed over all ranks", gt=0)
    micro_batch_size: int = key(32, "sequences per forward/backward pass, per rank", gt=0)
    micro_batch_tokens: int = key(
        0,
        "token budget of one forward/backward pass, per rank: sequences longest first, cut so that rows x longest row stays within it (a longer sequence alone); 0 = off "
        "(micro_batch_size rows)",
        min=0,
    )
    optim: OptimConfig = key(OptimConfig(lr=1e-3), "optimizer of the policy")


@dataclass(frozen=True)
class RMConfig:
    epochs: int = key(1, "passes over data.train", gt=0)
    batch_size: int = key(32, "preference pairs per optimizer step, summed over all ranks", gt=0)
    micro_batch_size: int = key(32, "preference pairs per forward/backward pass, per rank", gt=0)
    micro_batch_tokens: int = key(
        0,
        "token budget of one forward/backward pass, per rank: pairs longest first, cut so that 2 x pairs x longest sequence stays within it (a longer pair alone); 0 = off "
        "(micro_batch_size rows)",
        min=0,
    )
    optim: OptimConfig = key(OptimConfig(lr=1e-4), "optimizer of the reward model")
    responses_field: str = key(
        "responses", "column of ranked lists (best first), expanded to all C(n, 2) pairs"
    )


REFERENCE_LOGPROBS = ("precompute", "online")


@dataclass(frozen=True)
class DPOConfig:
    epochs: int = key(1, "passes over data.train", gt=0)
    batch_size: int = key(32, "preference pairs per optimizer step, summed over all ranks", gt=0)
    micro_batch_size: int = key(32, "preference pairs per forward/backward pass, per rank", gt=0)
    micro_batch_tokens: int = key(
        0,
        "token budget of one forward/backward pass, per rank: pairs longest first, cut so that 2 x pairs x longest sequence stays within it (a longer pair alone); 0 = off "
        "(micro_batch_size rows)",
        min=0,
    )
    optim: OptimConfig = key(OptimConfig(lr=1e-5), "optimizer of the policy")
    beta: float = key(
        0.1,
        "strength of the KL constraint to the reference: the implicit reward is beta x "
        "(log pi - log pi_ref); IPO's tau",
        gt=0,
    )
    loss_type: str = key(
        "sigmoid",
        "sigmoid: DPO (Rafailov et al. 2023), with dpo.label_smoothing conservative DPO; ipo: "
        "IPO (Azar et al. 2023), the log-ratio margin regressed onto 1 / (2 beta)",
        choices=("sigmoid", "ipo"),
    )
    label_smoothing: float = key(
        0.0,
        "conservative DPO: the probability that a label is flipped, in [0, 0.5); sigmoid only",
        min=0,
        lt=0.5,
    )
    reference_logprobs: str = key(
        "precompute",
        "reference log-probs computed in one pass over the data before training (kept in "
        "<output_dir>/reference_logprobs.json and reused on resume; a full-model reference is "
        "freed afterwards), or online: a reference forward in every step",
        choices=REFERENCE_LOGPROBS,
    )
    responses_field: str = key(
        "responses", "column of ranked lists (best first), expanded to all C(n, 2) pairs"
    )


@dataclass(frozen=True)
class KTOConfig:
    epochs: int = key(1, "passes over data.train", gt=0)
    batch_size: int = key(32, "examples per optimizer step, summed over all ranks", gt=0)
    micro_batch_size: int = key(32, "examples per forward/backward pass, per rank", gt=0)
    micro_batch_tokens: int = key(
        0,
        "token budget of one forward/backward pass, per rank: examples longest first, cut so that rows x longest row stays within it (a longer example alone); 0 = off "
        "(micro_batch_size rows)",
        min=0,
    )
    optim: OptimConfig = key(OptimConfig(lr=1e-5), "optimizer of the policy")
    beta: float = key(0.1, "scale of the implicit reward beta x (log pi - log pi_ref)", gt=0)
    desirable_weight: float = key(
        1.0, "lambda_D, the weight of desirable examples (raise it when they are fewer)", gt=0
    )
    undesirable_weight: float = key(1.0, "lambda_U, the weight of undesirable examples", gt=0)
    reference_logprobs: str = key(
        "precompute",
        "as dpo.reference_logprobs: one pass before training (resumable) or online",
        choices=REFERENCE_LOGPROBS,
    )
    completion_field: str = key(
        "completion",
        "column of an unpaired row's response (rows: prompt, completion, label); rows with "
        "chosen/rejected (or ranked responses) give desirable chosen and undesirable rejected",
    )
    label_field: str = key("label", "column of an unpaired row's label: true = desirable")
    responses_field: str = key(
        "responses",
        "column of ranked lists (best first): every response preferred to another is desirable, "
        "every one dispreferred undesirable (middle ones are both and are skipped)",
    )


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = key(32, "response tokens at most", gt=0)
    min_new_tokens: int = key(
        0, "EOS is suppressed until this many tokens were generated (0: no minimum)", min=0
    )
    temperature: float = key(0.7, "sampling temperature (PPO's log-probabilities use it too)", gt=0)
    top_k: int = key(0, "sample among the k most likely tokens; 0 = all", min=0)
    top_p: float = key(
        1.0, "nucleus sampling: the smallest set of tokens with this mass; 1 = all", gt=0, max=1
    )
    stop_token_ids: tuple[int, ...] = key(
        (),
        "token ids that end a response besides the tokenizer's EOS, the policy's "
        "generation_config.eos_token_id and the chat template's end-of-turn token (docs/data.md)",
        min=0,
    )
    backend: str = key(
        "hf",
        "what samples PPO rollouts: hf (our decode loop over the actor, the reference) or vllm "
        "(one in-process vLLM engine per rank, weights synced before every rollout; needs the "
        "vllm extra, docs/distributed.md)",
        choices=("hf", "vllm"),
    )
    vllm_gpu_memory_utilization: float = key(
        0.3,
        "vllm on GPU: share of the GPU's memory the engine takes (weights + KV cache)",
        gt=0,
        max=1,
    )
    vllm_kv_cache_gib: float = key(
        0.0,
        "vllm: KV cache per rank in GiB; 0 = from vllm_gpu_memory_utilization (GPU), 1 (CPU)",
        min=0,
    )
    vllm_max_model_len: int = key(
        0,
        "vllm: longest prompt + response the engine accepts; 0 = the model's context length",
        min=0,
    )
    vllm_sleep: bool = key(
        True,
        "vllm on GPU: free the engine's KV cache and offload its weights during the update "
        "(sleep mode), woken before the next rollout; CPU engines do not sleep",
    )
    vllm_enforce_eager: bool = key(
        False, "vllm on GPU: no CUDA graphs or compilation (faster start); CPU engines always eager"
    )
    tools: tuple[str, ...] = key(
        (),
        "multi-turn rollouts with tools (docs/agents.md): module:callable functions the policy "
        'may call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>; their JSON '
        "schemas (type hints + Args docstring, or a `schema` attribute) go to the chat template",
    )
    environment: str = key(
        "",
        "multi-turn rollouts with an environment (docs/agents.md): module:factory returning an "
        "object with reset(prompt) -> messages and step(messages) -> (new messages, done, "
        "reward or None); a fresh one per episode. Not together with generation.tools",
    )
    max_turns: int = key(
        4, "multi-turn rollouts: assistant turns per episode at most (then truncated)"
    )
    max_episode_tokens: int = key(
        0,
        "multi-turn rollouts: tokens after the prompt per episode at most, sampled turns and "
        "tool/environment messages together; 0 = max_turns x max_new_tokens",
    )
    tool_timeout_s: float = key(
        10.0, "multi-turn rollouts: seconds a tool call may run; then the model reads an error"
    )


@dataclass(frozen=True)
class RewardConfig:
    function: str = key(
        "",
        "module:callable taking (prompts, responses) -> list[float]; overrides model.reward. "
        "prompts are texts, or message lists for conversational data; responses are texts",
    )
    missing_eos_penalty: float | None = key(
        None, "replace the score of a response without EOS by this value (N+ study uses -1)"
    )
    normalize: bool = key(
        False,
        "running normalisation of scores (mean/std over all ranks, updated every iteration), "
        "after the missing-EOS penalty",
    )
    clip: float | None = key(
        None,
        "clip (normalised) scores to [-clip, clip], after the missing-EOS penalty; null = no",
        gt=0,
    )
    retries: int = key(
        2,
        "reward.function: calls that raise or time out are tried again this many times, "
        "with exponential backoff; then the run checkpoints its last completed iteration and "
        "stops (exit 2; continue with --resume auto). A reward model's forward is not retried",
        min=0,
    )
    retry_delay_s: float = key(
        1.0,
        "seconds before the first retry of reward.function; each further retry waits twice as long",
        min=0,
    )
    timeout_s: float | None = key(
        None,
        "reward.function: stop waiting for a call after this many seconds (a failure, retried); "
        "the call runs in a worker thread, which cannot be killed and is left behind; null = wait",
        gt=0,
    )
    functions: tuple[str, ...] = key(
        (),
        "several reward functions (module:callable each, as reward.function): the score is "
        "sum_i weights[i] x f_i, each f_i logged as objective/score_<name> (docs/rewards.md); "
        "not with reward.function. Like reward.function, they replace model.reward as the score",
    )
    weights: tuple[float, ...] = key(
        (), "one weight per reward.functions entry; empty = all 1", finite=True
    )
    url: str = key(
        "",
        "remote reward model: POST {prompts, responses} -> {scores} to this URL, a reward "
        "component of weight reward.url_weight (protocol: docs/rewards.md)",
    )
    url_weight: float = key(1.0, "weight of the reward.url component", finite=True)
    remote_batch_size: int = key(
        32,
        "responses per reward.url request; concurrent requests to reward.judge_url; prompts "
        "per generation batch of a local judge",
        gt=0,
    )
    api_key_env: str = key(
        "",
        "name of the environment variable holding the API key for reward.url and "
        "reward.judge_url (sent as 'Authorization: Bearer ...'; the key itself is never "
        "logged or written); empty = no key",
    )
    judge: str = key(
        "none",
        "a generative judge as a reward component of weight reward.judge_weight, and eval's "
        "judge_win_rate: model = a local causal LM (reward.judge_model), url = an "
        "OpenAI-compatible chat-completions endpoint (reward.judge_url)",
        choices=("none", "model", "url"),
    )
    judge_model: str = key(
        "",
        "reward.judge=model: path of the judge causal LM (frozen, in model.dtype, replicated "
        "on every rank, greedy decoding)",
    )
    judge_url: str = key(
        "",
        "reward.judge=url: base URL of an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1); "
        "requests go to <judge_url>/chat/completions",
    )
    judge_model_name: str = key("", "reward.judge=url: the 'model' field of each request")
    judge_template: str = key(
        "Rate the response to the prompt on a scale of 1 to 10, where 10 is best. "
        "Answer with the number only.\n\nPrompt: {prompt}\n\nResponse: {response}\n\nScore:",
        "the judge's prompt; {prompt} and {response} are replaced (a message-list prompt "
        "by its messages as 'role: content' lines); the first number of the reply is the score",
    )
    judge_max_new_tokens: int = key(8, "tokens the judge may write in its reply", gt=0)
    judge_fallback_score: float | None = key(
        0.0,
        "score of a judge reply without a number (counted as objective/judge_parse_failures); "
        "null = such a reply is a reward failure (the run stops as for reward.function)",
        finite=True,
    )
    judge_weight: float = key(1.0, "weight of the judge component", finite=True)

    def text_rewards(self) -> bool:
        """Whether scores come from text-reading rewards (reward.function(s), url, judge)
        rather than model.reward."""
        return bool(self.function or self.functions or self.url or self.judge != "none")


@dataclass(frozen=True)
class PPOConfig:
    iterations: int = key(100, "rollout + update rounds", gt=0)
    rollout_batch_size: int = key(64, "prompts per iteration, summed over all ranks", gt=0)
    samples_per_prompt: int = key(
        1,
        "responses sampled per prompt (n); an iteration has rollout_batch_size x n sequences, "
        "the n samples of a prompt always on one rank (group estimators need n >= 2)",
        gt=0,
    )
    estimator: str = key(
        "gae",
        "advantage estimator (rlhf_dist/algo/estimators.py): gae (with a critic), grpo, rloo, "
        "reinforce_pp, reinforce_pp_baseline (critic-free: no critic is built)",
        choices=tuple(ESTIMATORS),
    )
    grpo_std_normalize: bool = key(
        True, "grpo: divide by the group's reward std; false = Dr. GRPO (mean baseline only)"
    )
    rollout_micro_batch_size: int = key(
        64, "sequences per forward pass during rollout scoring and generation, per rank", gt=0
    )
    ppo_epochs: int = key(4, "passes over each rollout batch", gt=0)
    minibatch_size: int = key(16, "sequences per optimizer step, summed over all ranks", gt=0)
    micro_batch_size: int = key(16, "sequences per forward/backward pass, per rank", gt=0)
    micro_batch_tokens: int = key(
        0,
        "token budget of one forward/backward pass, per rank: the update's rows longest first, cut so that rows x (longest prompt + longest response) stays within it (a longer row alone); every rank runs as many passes as the busiest; 0 = off "
        "(micro_batch_size rows)",
        min=0,
    )
    loss_aggregation: str = key(
        "token_mean",
        "how per-token losses make one loss: token_mean over all tokens of the minibatch, "
        "seq_mean_token_sum (per-sequence sums averaged; Dr. GRPO) or seq_mean_token_mean "
        "(per-sequence means averaged; GRPO's paper)",
        choices=LOSS_AGGREGATIONS,
    )
    actor: OptimConfig = key(OptimConfig(lr=1e-5), "optimizer of the actor (the policy)")
    critic: OptimConfig = key(OptimConfig(lr=1e-5), "optimizer of the critic (value model)")
    critic_init: str = key(
        "reward",
        "the critic starts from the reward model or from the policy (with a new value head)",
        choices=("reward", "policy"),
    )
    clip_eps: float | None = key(
        0.2, "policy ratio clip; null turns clipping off (a debugging knob)", gt=0
    )
    clip_eps_low: float | None = key(
        None, "lower ratio clip 1 - clip_eps_low; null = clip_eps", gt=0, max=1
    )
    clip_eps_high: float | None = key(
        None,
        "upper ratio clip 1 + clip_eps_high (> clip_eps: DAPO's clip-higher); null = clip_eps",
        gt=0,
    )
    dual_clip: float | None = key(
        None,
        "dual-clip constant c > 1: a negative-advantage token's loss is at most -c*A; null = off",
        gt=1,
    )
    entropy_coef: float = key(
        0.0, "weight of the entropy bonus in the policy loss; 0 = none", min=0
    )
    ptx_coef: float = key(
        0.0,
        "PPO-ptx (InstructGPT eq. 2): weight of the token-mean NLL of a batch of data.ptx rows "
        "(ppo.minibatch_size rows per optimizer step, a seed-determined stream) added to the "
        "actor's loss; 0 = off",
        min=0,
    )
    tis_cap: float | None = key(
        None,
        "generation.backend=vllm: weight each token's policy loss by the truncated importance "
        "ratio min(pi_old / pi_vllm, tis_cap) between the trainer's and vLLM's sampling "
        "probabilities (TIS, Yao et al. 2025; typical 2); null = off",
        gt=0,
    )
    ratio_level: str = key(
        "token",
        "importance ratio of the policy loss: token (PPO's pi/pi_old per token) or sequence "
        "(GSPO, Zheng et al. 2025: the row's length-normalised ratio exp(mean_t log pi/pi_old) "
        "on every token, gradients per token; GSPO's paper pairs it with "
        "loss_aggregation=seq_mean_token_mean and a small clip_eps)",
        choices=RATIO_LEVELS,
    )
    policy_loss: str = key(
        "clip",
        "policy loss: clip (PPO's clipped surrogate) or cispo (MiniMax-M1 2025: "
        "-sg[clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high)] * A * logprob, every token keeps "
        "a gradient; clip_eps_low=1 is MiniMax's upper bound only; no dual_clip)",
        choices=POLICY_LOSSES,
    )
    dynamic_sampling: bool = key(
        False,
        "DAPO dynamic sampling (Yu et al. 2025): drop prompt groups whose n scores all tie "
        "(no group-baseline signal) and roll out more prompts until every rank's batch is "
        "full; needs a group estimator (grpo, rloo, reinforce_pp_baseline)",
    )
    dynamic_sampling_max_rounds: int = key(
        3,
        "dynamic sampling: extra rollout rounds per iteration at most (all ranks run the same "
        "number); a batch still short after them is topped up with tied groups",
        min=1,
    )
    overlong: str = key(
        "none",
        "DAPO's overlong handling of truncated responses (no stop token within "
        "generation.max_new_tokens): none; mask (they are left out of the loss); soft (the "
        "length penalty of DAPO eq. 13 over the last overlong_buffer tokens is added to the score)",
        choices=OVERLONG,
    )
    overlong_buffer: int = key(
        4,
        "overlong=soft: L_cache, the last tokens before generation.max_new_tokens over which "
        "the penalty falls from 0 to -1",
    )
    value_clip_eps: float | None = key(
        0.2, "clip of the value update around the rollout's values; null = off", gt=0
    )
    vf_coef: float = key(0.1, "weight of the value loss")
    gamma: float = key(1.0, "discount of GAE", min=0, max=1)
    lam: float = key(0.95, "lambda of GAE", min=0, max=1)
    kl_coef: float = key(
        0.05, "weight of the per-token KL penalty in the reward (initial, if adaptive)", min=0
    )
    kl_placement: str = key(
        "reward",
        "where the KL to the reference acts: reward (a per-token penalty in the rewards, "
        "InstructGPT) or loss (kl_coef x the kl_kind estimate added to the policy loss, GRPO)",
        choices=("reward", "loss"),
    )
    kl_kind: str = key(
        "k1",
        "estimator of the per-token KL to the reference (Schulman 2020): k1 = log ratio, "
        "k2 = its square / 2, k3 = exp(-d) + d - 1",
        choices=KL_KINDS,
    )
    kl_controller: str = key(
        "fixed",
        "fixed kl_coef, or adaptive: steered towards ppo.kl_target (Ziegler et al. 2019)",
        choices=("fixed", "adaptive"),
    )
    kl_target: float = key(
        6.0, "adaptive controller: KL per response to steer towards (nats)", gt=0
    )
    kl_horizon: float = key(
        10000.0, "adaptive controller: its horizon (how slowly it adapts)", gt=0
    )
    whiten_advantages: bool | None = key(
        None,
        "normalise advantages to mean 0, std 1 (statistics over all ranks); null = the "
        "estimator's rule: on for gae and reinforce_pp*, off for grpo and rloo",
    )


@dataclass(frozen=True)
class EvalConfig:
    reference: str = key(
        "", "reference policy for the KL figure; empty: the run's model.policy has none"
    )
    num_prompts: int = key(128, "held-out prompts scored at most", gt=0)
    batch_size: int = key(64, "prompts per generation batch, per rank", gt=0)
    gold_function: str = key(
        "",
        "optional oracle module:callable(prompts, responses, finished) -> list[float], "
        "e.g. the demo task's gold reward, reported as gold_reward",
    )


@dataclass(frozen=True)
class AlertsConfig:
    enabled: bool = key(
        True,
        "PPO health alerts (rlhf_dist/alerts.py), each printed once and logged as alerts/<name>",
    )
    kl_max: float = key(
        20.0, "KL per response to the reference (nats) above which kl_high fires", gt=0
    )
    length_drift: float = key(
        0.5, "length_drift fires when |mean length / first iteration's - 1| exceeds this", gt=0
    )
    window: int = key(5, "iterations over which score and KL trends are judged", min=1)
    kl_rise_per_iteration: float = key(
        1.0,
        "score_up_kl_fast fires when KL grows faster (nats/iteration) while the score rises",
        min=0,
    )
    score_std_collapse: float = key(
        0.8,
        "fall of the score std relative to the first iteration that fires an alert",
        gt=0,
        max=1,
    )
    clipfrac_max: float = key(
        0.3, "policy clip fraction above which clipfrac_high fires", gt=0, max=1
    )
    approx_kl_max: float = key(0.1, "approx. KL per update above which approx_kl_high fires", gt=0)
    entropy_collapse: float = key(
        0.7, "fall of the entropy relative to the first iteration that fires an alert", gt=0, max=1
    )


@dataclass(frozen=True)
class DebugConfig:
    overfit_one_batch: bool = key(
        False,
        "PPO on the SAME prompts every iteration: the score must climb, or something is broken",
    )
    print_first_batch: bool = key(
        False, "print the first rollout batch decoded token by token with its masks"
    )
    check_vllm_sync: bool = key(
        False,
        "generation.backend=vllm: after every weight sync, greedy-decode a few prompts with "
        "both vLLM and the actor itself; different tokens stop the run (a sync that did not "
        "take). Exact in fp32; bf16 kernels may legitimately differ at near-ties",
    )


@dataclass(frozen=True)
class LoRAConfig:
    enabled: bool = key(
        False,
        "LoRA adapters (peft) on the actor; the reference is the same base with adapters "
        "disabled, so the base weights are held once (LoRA dropout is always 0)",
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
    )
    load_in_4bit: bool = key(
        False,
        "QLoRA: load the LoRA base in 4-bit (bitsandbytes NF4, compute in model.dtype) with "
        "the adapters trained in fp32/bf16; the merged export is dequantized (docs/distributed.md, "
        "QLoRA). Needs lora.enabled, bitsandbytes, and no DeepSpeed",
    )
    export: str = key(
        "both",
        "what final/ holds for a LoRA actor: the merged model, and/or the adapter in final_adapter/",
        choices=("merged", "adapter", "both"),
    )


@dataclass(frozen=True)
class DistributedConfig:
    frozen_models: str = key(
        "auto",
        "frozen reference / reward model: partition them like ZeRO-3 (inference engines), "
        "replicate a full copy per rank, offload their partitions to CPU memory; auto = "
        "replicate when a copy takes at most a quarter of the free memory (printed), else "
        "partition under ZeRO-3",
        choices=("auto", "partition", "replicate", "offload"),
    )
    gather_for_generation: bool = key(
        True,
        "under ZeRO-3, gather the actor's full weights once per rollout for generation (fast; "
        "needs memory for one full copy); off: generate through ZeRO-3's per-layer gathers",
    )
    gather_for_training: str = key(
        "auto",
        "under ZeRO-3, gather the trained model's full weights once per optimizer step "
        "(one collective, ZeRO-3's per-module hooks off; gradients and optimizer states "
        "stay partitioned) instead of per layer in every forward and backward; auto = when "
        "a full copy takes at most a quarter of the free memory (printed)",
        choices=("auto", "always", "never"),
    )
    timeout_s: int = key(
        1800,
        "seconds a collective waits for the other ranks before the run fails with an error",
        gt=0,
    )


@dataclass(frozen=True)
class IterateConfig:
    rounds: int = key(2, "rlhf-dist iterate: rounds of sample pairs -> label -> RM -> PPO", gt=0)
    labeller: str = key(
        "gold",
        "who labels each sampled pair: gold = Bradley-Terry labels on eval.gold_function at "
        "iterate.label_beta (the demo's oracle); or module:function(prompt, a, b) returning "
        "True/False (a preferred / b preferred) or P(a preferred) in [0, 1], drawn as a label "
        "(docs/iterate.md)",
    )
    label_beta: float = key(
        10.0, "labeller=gold: P(a preferred) = sigmoid(label_beta x (gold(a) - gold(b)))", gt=0
    )
    rm_init: str = key(
        "continue",
        "each round's reward model starts from the last round's (continue; round 1 from "
        "model.reward if set, else model.policy) or afresh from model.policy (fresh)",
        choices=("continue", "fresh"),
    )
    pairs_per_round: int = key(
        256, "answer pairs sampled from the current policy on data.train prompts each round", gt=0
    )
    heldout_pairs: int = key(
        128,
        "labelled pairs sampled from each round's final policy on data.eval prompts, for "
        "rm_accuracy_on_this_policy / _on_previous_policy",
        gt=0,
    )


@dataclass(frozen=True)
class Config:
    run: RunConfig = key(RunConfig(), "output, logging, checkpoints, resume")
    model: ModelConfig = key(ModelConfig(), "which models, their dtype and loading")
    data: DataConfig = key(DataConfig(), "data files and tokenisation limits")
    sft: SFTConfig = key(SFTConfig(), "batches and optimizer of rlhf-dist sft")
    rm: RMConfig = key(RMConfig(), "batches and optimizer of rlhf-dist rm")
    ppo: PPOConfig = key(PPOConfig(), "batches, optimizers, losses and KL penalty of rlhf-dist ppo")
    dpo: DPOConfig = key(
        DPOConfig(), "batches, optimizer and loss of rlhf-dist dpo (DPO, cDPO, IPO)"
    )
    kto: KTOConfig = key(KTOConfig(), "batches, optimizer and loss of rlhf-dist kto")
    generation: GenerationConfig = key(GenerationConfig(), "sampling of responses (PPO, eval)")
    reward: RewardConfig = key(
        RewardConfig(), "the reward: a function instead of model.reward, shaping"
    )
    eval: EvalConfig = key(EvalConfig(), "what rlhf-dist eval scores and compares")
    lora: LoRAConfig = key(LoRAConfig(), "LoRA adapters (PPO, DPO, KTO)")
    alerts: AlertsConfig = key(AlertsConfig(), "PPO health and reward-hacking alerts")
    debug: DebugConfig = key(DebugConfig(), "debugging aids (PPO)")
    distributed: DistributedConfig = key(
        DistributedConfig(), "placement of models across ranks, timeouts"
    )
    iterate: IterateConfig = key(
        IterateConfig(), "rlhf-dist iterate: rounds of sampling, labelling, RM and PPO"
    )


# ---------------------------------------------------------------------------- building


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    """(True, inner) for `X | None`; (False, tp) otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _parse_scalar(text: str) -> Any:
    """A command-line value as YAML would read it (`1`, `true`, `null`, `[a, b]`, text)."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    optional, inner = _is_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("null", "none")):
        if optional:
            return None
        raise ConfigError(f"{key}: must not be null")
    if inner is bool:
        if isinstance(value, bool):
            return value
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as text
            try:
                return float(value)
            except ValueError:
                pass
    elif inner is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif typing.get_origin(inner) is tuple:
        item = typing.get_args(inner)[0]
        items = [value] if isinstance(value, (str, int)) else value
        if (
            item is str
            and isinstance(items, (list, tuple))
            and all(isinstance(v, str) for v in items)
        ):
            return tuple(v for v in items if v)
        if item is int and isinstance(items, (list, tuple)) and all(_is_int(v) for v in items):
            return tuple(items)
        if item is float and isinstance(items, (list, tuple, int, float)):
            items = [items] if isinstance(items, (int, float)) else items
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
                return tuple(float(v) for v in items)
    name = getattr(inner, "__name__", str(inner))
    raise ConfigError(f"{key}: expected {name}, got {value!r} ({type(value).__name__})")


def _check_choices(name: str, f: dataclasses.Field, value: Any) -> None:
    """A key declared with `choices`: its value (each item of a list key) is one of them."""
    choices = f.metadata.get("choices")
    items = value if isinstance(value, tuple) else (value,)
    bad = [v for v in items if choices and v not in choices]
    if bad:
        raise ConfigError(f"{name}: must be one of {', '.join(choices)}, got {bad[0]!r}")


def _check_range(name: str, f: dataclasses.Field, value: Any) -> None:
    """A key declared with a range: its value (each item of a list key) lies in it; null
    passes (only optional keys can hold it)."""
    bounds = f.metadata.get("range")
    if bounds is None or value is None:
        return
    if isinstance(value, tuple):
        if not all(in_range(v, bounds) for v in value):
            raise ConfigError(f"{name}: each must be {range_text(bounds)}, got {list(value)}")
    elif not in_range(value, bounds):
        null = " or null" if f.default is None else ""
        raise ConfigError(f"{name}: must be {range_text(bounds)}{null}, got {value}")


def check_keys(cfg: Config) -> None:
    """Every key's declared choices and range (key(...)), in every section."""
    for name, f, _, value in _walk(cfg):
        if not dataclasses.is_dataclass(value):
            _check_choices(name, f, value)
            _check_range(name, f, value)


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            known = ", ".join(sorted(names))
            raise ConfigError(f"{full}: unknown key (known here: {known})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            default = names[key].default
            base = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else {}
            kwargs[key] = _build(tp, _deep_merge(base, value, full), f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full)
            if not isinstance(kwargs[key], tuple):  # list keys: in validate, with the ranges
                _check_choices(full, names[key], kwargs[key])
    return cls(**kwargs)


def _deep_merge(base: dict, extra: Any, key: str) -> dict:
    if not isinstance(extra, dict):
        raise ConfigError(f"{key}: expected a mapping, got {extra!r}")
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v, f"{key}.{k}") if isinstance(out.get(k), dict) else v
    return out


def apply_override(tree: dict, override: str) -> dict:
    """Return a copy of `tree` with one `a.b.c=value` override applied."""
    if "=" not in override:
        raise ConfigError(f"{override}: overrides look like section.key=value")
    dotted, text = override.split("=", 1)
    parts = dotted.strip().split(".")
    if not all(parts):
        raise ConfigError(f"{dotted}: overrides look like section.key=value")
    out = dict(tree)
    node = out
    for part in parts[:-1]:
        child = node.get(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node[part] = dict(child)
        node = node[part]
    node[parts[-1]] = _parse_scalar(text)
    return out


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Config from a YAML file (safe-loaded) and `section.key=value` overrides, in order."""
    tree: dict = {}
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--config {path}: cannot read (not UTF-8 text)") from None
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            raise ConfigError(f"--config {path}: invalid YAML{line}") from None
        if not isinstance(tree, dict):
            raise ConfigError(
                f"--config {path}: expected a mapping of sections, got {type(tree).__name__}"
            )
    for override in overrides:
        tree = apply_override(tree, override)
    return config_from_dict(tree)


def config_from_dict(tree: dict) -> Config:
    return _build(Config, tree, "")


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples become lists) for YAML/JSON output."""

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(dataclasses.asdict(cfg))


def save_config(cfg: Config, output_dir: str | os.PathLike) -> Path:
    """Write the effective config to `<output_dir>/config.yaml` (atomically) and return its path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(out / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))


# -------------------------------------------------------------------------------- help


def _type_name(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if typing.get_origin(inner) is tuple:
        name = f"list of {typing.get_args(inner)[0].__name__}"
    else:
        name = inner.__name__
    return f"{name} or null" if optional else name


def _walk(section: Any, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any, Any]]:
    """(dotted name, field, type, default) of every key and subsection under `section` (an
    instance, so nested defaults such as sft.optim.lr are the section's own), in order."""
    hints, out = _hints(type(section)), []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        out.append((f"{prefix}{f.name}", f, hints[f.name], value))
        if dataclasses.is_dataclass(value):
            out += _walk(value, f"{prefix}{f.name}.")
    return out


def describe(section: str = "") -> str:
    """Every key under `section` ("" = all; "ppo", "ppo.actor" or one key) with its type,
    default, choices or range, and meaning: the text of `rlhf-dist config [SECTION]`."""
    entries = [e for e in _walk(Config()) if not section or f"{e[0]}.".startswith(f"{section}.")]
    if not entries:
        known = ", ".join(f.name for f in dataclasses.fields(Config))
        raise ConfigError(f"{section}: no such section or key (sections: {known})")
    lines = []
    for name, f, tp, value in entries:
        text = f.metadata.get("help", "")
        if dataclasses.is_dataclass(value):
            lines += ([""] if "." not in name and lines else []) + [f"{name}: {text}"]
            continue
        default = json.dumps(list(value) if isinstance(value, tuple) else value)
        choices, bounds = f.metadata.get("choices"), f.metadata.get("range")
        head = f"  {name}  {_type_name(tp)} = {default}"
        head += f"  (one of: {', '.join(choices)})" if choices else ""
        if bounds is not None:
            each = "each " if typing.get_origin(_is_optional(tp)[1]) is tuple else ""
            null = " or null" if f.default is None else ""
            head += f"  ({each}{range_text(bounds)}{null})"
        lines += [
            head,
            textwrap.fill(
                text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False
            ),
        ]
    return "\n".join(lines)


# -------------------------------------------------------------------------- validation


def _divides(small: tuple[str, int], big: tuple[str, int]) -> None:
    if big[1] % small[1]:
        raise ConfigError(f"{small[0]}={small[1]} must divide {big[0]}={big[1]}")


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def validate(cfg: Config, stage: str, world_size: int = 1) -> None:
    """Check `cfg` for `stage` ("sft", "rm", "dpo", "kto", "ppo", "eval", "iterate"): every
    key's declared choices and range (`check_keys`), then the rules between keys that
    stage uses; raise ConfigError naming one."""
    check_keys(cfg)
    if cfg.model.attn_implementation == "flash_attention_2" and not _installed("flash_attn"):
        raise ConfigError(
            "model.attn_implementation: flash_attention_2 needs the flash-attn package "
            "(pip install flash-attn) and a CUDA GPU; use sdpa or auto otherwise"
        )
    if stage in ("sft", "rm", "dpo", "kto"):
        section = getattr(cfg, stage)
        _divides(
            (
                f"{stage}.micro_batch_size x {world_size} ranks",
                section.micro_batch_size * world_size,
            ),
            (f"{stage}.batch_size", section.batch_size),
        )
        if not cfg.data.train:
            raise ConfigError("data.train: required (a local data file or a hub dataset name)")
        if stage == "sft" and not cfg.model.policy:
            raise ConfigError("model.policy: required (the causal LM to fine-tune)")
        if stage == "rm" and not (cfg.model.reward or cfg.model.policy):
            raise ConfigError("model.reward: required (the model to train as reward model)")
    if stage in ("dpo", "kto"):
        _validate_preference(cfg, stage)
    if stage == "ppo":
        _validate_ppo(cfg, world_size)
    if stage == "iterate":
        _validate_iterate(cfg, world_size)
    if cfg.lora.critic and not cfg.lora.enabled:
        raise ConfigError("lora.critic: needs lora.enabled=true")
    if cfg.lora.load_in_4bit:
        _validate_4bit(cfg)
    if stage in ("ppo", "eval"):
        _validate_generation(cfg)
        if not cfg.model.policy:
            raise ConfigError("model.policy: required (the SFT policy)")
        if not (cfg.reward.text_rewards() or cfg.model.reward):
            raise ConfigError(
                "model.reward: required unless reward.function, reward.functions, reward.url "
                "or reward.judge is set"
            )
        for spec in (cfg.reward.function, *cfg.reward.functions):
            if spec and ":" not in spec:
                raise ConfigError(f"reward.function: expected 'module:callable', got {spec!r}")
        _validate_reward_sources(cfg.reward)


def _validate_4bit(cfg: Config) -> None:
    """lora.load_in_4bit: LoRA on, and a bitsandbytes that loads with a usable backend."""
    if not cfg.lora.enabled:
        raise ConfigError("lora.load_in_4bit: needs lora.enabled=true (QLoRA trains adapters)")
    problem = bitsandbytes_problem()
    if problem:
        raise ConfigError(f"lora.load_in_4bit: {problem}")


def bitsandbytes_problem() -> str:
    """Why bitsandbytes cannot quantize to NF4 here ("" when it can): checked by
    quantizing one small tensor, which fails where no backend (CUDA or CPU) exists."""
    if not _installed("bitsandbytes"):
        return "needs the bitsandbytes package (pip install bitsandbytes)"
    try:
        import torch
        from bitsandbytes.functional import dequantize_4bit, quantize_4bit

        device = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.ones(64, 4, device=device)
        packed, state = quantize_4bit(x, quant_type="nf4")
        dequantize_4bit(packed, state)
    except Exception as e:  # no backend for this device, a broken build
        return f"bitsandbytes has no usable NF4 backend here ({type(e).__name__}: {e})"
    return ""


def _validate_reward_sources(r) -> None:
    """Several rewards, the remote reward model and the judge (docs/rewards.md)."""
    if r.function and r.functions:
        raise ConfigError("reward.function and reward.functions: set one of them, not both")
    if r.weights and len(r.weights) != len(r.functions):
        raise ConfigError(
            f"reward.weights: {len(r.weights)} weights for {len(r.functions)} reward.functions"
        )
    for name in ("url", "judge_url"):
        value = getattr(r, name)
        if value and not value.startswith(("http://", "https://")):
            raise ConfigError(f"reward.{name}: expected an http:// or https:// URL, got {value!r}")
    if r.judge == "model" and not r.judge_model:
        raise ConfigError("reward.judge_model: required with reward.judge=model (a causal LM path)")
    if r.judge == "url" and not (r.judge_url and r.judge_model_name):
        raise ConfigError(
            "reward.judge_url and reward.judge_model_name: required with reward.judge=url"
        )
    if r.judge != "none" and not (
        "{prompt}" in r.judge_template and "{response}" in r.judge_template
    ):
        raise ConfigError("reward.judge_template: must contain {prompt} and {response}")
    if r.api_key_env and not r.api_key_env.replace("_", "").isalnum():
        raise ConfigError(
            f"reward.api_key_env: the NAME of an environment variable, got {r.api_key_env!r}"
        )


def _validate_objective(cfg: Config) -> None:
    """The estimator's needs and the policy-loss knobs (clip bounds, dual clip, entropy)."""
    p = cfg.ppo
    estimator = ESTIMATORS[p.estimator]
    if estimator.needs_groups and p.samples_per_prompt < 2:
        raise ConfigError(
            f"ppo.samples_per_prompt: estimator {p.estimator} compares the samples of a prompt; "
            f"needs >= 2, got {p.samples_per_prompt}"
        )
    if not estimator.needs_critic and cfg.lora.critic:
        raise ConfigError(f"lora.critic: estimator {p.estimator} trains no critic; set it false")
    for name in ("clip_eps_low", "clip_eps_high", "dual_clip"):
        if getattr(p, name) is not None and p.clip_eps is None:
            raise ConfigError(f"ppo.{name}: needs ppo.clip_eps set (clipping on)")
    if p.clip_eps_low is not None and p.clip_eps_low >= 1 and p.policy_loss != "cispo":
        raise ConfigError(
            f"ppo.clip_eps_low: must be < 1 (1 = no lower bound: cispo only), got {p.clip_eps_low}"
        )
    if p.policy_loss == "cispo" and p.dual_clip is not None:
        raise ConfigError(
            "ppo.dual_clip: bounds PPO's clipped surrogate (policy_loss=clip); cispo's weight "
            "is already bounded, set dual_clip null"
        )
    _validate_dapo(cfg)
    if p.tis_cap is not None and cfg.generation.backend != "vllm":
        raise ConfigError(
            "ppo.tis_cap: needs generation.backend=vllm (the hf sampler is the trainer)"
        )


def _validate_dapo(cfg: Config) -> None:
    """Dynamic sampling and overlong handling (DAPO, Yu et al. 2025)."""
    p = cfg.ppo
    if p.dynamic_sampling:
        if not ESTIMATORS[p.estimator].needs_groups:
            raise ConfigError(
                f"ppo.dynamic_sampling: drops groups of tied scores, so it needs a group "
                f"estimator (grpo, rloo, reinforce_pp_baseline), got ppo.estimator={p.estimator}"
            )
        if cfg.debug.overfit_one_batch:
            raise ConfigError(
                "ppo.dynamic_sampling: extra rounds draw other prompts; it cannot be combined "
                "with debug.overfit_one_batch"
            )
    if p.overlong == "soft" and not 0 < p.overlong_buffer <= cfg.generation.max_new_tokens:
        raise ConfigError(
            f"ppo.overlong_buffer: must be in [1, generation.max_new_tokens="
            f"{cfg.generation.max_new_tokens}] with ppo.overlong=soft, got {p.overlong_buffer}"
        )


def _validate_preference(cfg: Config, stage: str) -> None:
    """dpo / kto: the policy to train and the loss's constants."""
    section = getattr(cfg, stage)
    if not cfg.model.policy:
        raise ConfigError(f"model.policy: required (the SFT policy {stage} trains)")
    if stage == "dpo" and section.label_smoothing and section.loss_type != "sigmoid":
        raise ConfigError(
            f"dpo.label_smoothing: conservative DPO smooths the sigmoid loss only; "
            f"dpo.loss_type={section.loss_type} takes label_smoothing=0"
        )


def _validate_generation(cfg: Config) -> None:
    g = cfg.generation
    if g.min_new_tokens > g.max_new_tokens:
        raise ConfigError(
            f"generation.min_new_tokens: must be in [0, max_new_tokens], got {g.min_new_tokens}"
        )
    if g.tools or g.environment:
        _validate_multi_turn(cfg)
    if g.backend == "vllm" and not cfg.distributed.gather_for_generation:
        raise ConfigError(
            "generation.backend=vllm: needs distributed.gather_for_generation=true (the engine "
            "loads whole weights, gathered once per rollout)"
        )


def _validate_multi_turn(cfg: Config) -> None:
    """generation.tools / environment: what multi-turn rollouts support (docs/agents.md)."""
    g = cfg.generation
    if g.tools and g.environment:
        raise ConfigError("generation.tools: not together with generation.environment")
    for spec in (*g.tools, g.environment):
        if spec and ":" not in spec:
            raise ConfigError(
                f"generation.tools/environment: expected 'module:callable', got {spec!r}"
            )
    if g.max_turns < 1 or g.max_episode_tokens < 0 or not g.tool_timeout_s > 0:
        raise ConfigError(
            "generation.max_turns must be >= 1, max_episode_tokens >= 0 and tool_timeout_s > 0"
        )


def _validate_ppo(cfg: Config, world_size: int) -> None:
    p = cfg.ppo
    _divides(("world size", world_size), ("ppo.rollout_batch_size", p.rollout_batch_size))
    sequences = p.rollout_batch_size * p.samples_per_prompt
    _divides(
        ("ppo.minibatch_size", p.minibatch_size),
        ("ppo.rollout_batch_size x ppo.samples_per_prompt", sequences),
    )
    _divides(
        (f"ppo.micro_batch_size x {world_size} ranks", p.micro_batch_size * world_size),
        ("ppo.minibatch_size", p.minibatch_size),
    )
    _validate_objective(cfg)
    if not cfg.data.train:
        raise ConfigError("data.train: required (a prompt file or a hub dataset name)")
    if p.ptx_coef > 0 and not cfg.data.ptx:
        raise ConfigError(
            f"ppo.ptx_coef: {p.ptx_coef} needs data.ptx (the SFT-format rows of the ptx term)"
        )
    if cfg.data.ptx and not p.ptx_coef > 0:
        raise ConfigError(
            "data.ptx: set, but ppo.ptx_coef is 0 (ptx off): set ppo.ptx_coef > 0 or leave "
            "data.ptx empty"
        )


def _validate_iterate(cfg: Config, world_size: int) -> None:
    """rlhf-dist iterate: its own keys, then the RM, PPO and eval stages it derives (with
    the reward model each round trains standing in for model.reward)."""
    it = cfg.iterate
    if it.labeller == "gold" and not cfg.eval.gold_function:
        raise ConfigError(
            "iterate.labeller: gold labels with eval.gold_function, which is not set "
            "(set it, or name a module:function(prompt, a, b) labeller)"
        )
    if it.labeller != "gold" and ":" not in it.labeller:
        raise ConfigError(
            f"iterate.labeller: expected gold or 'module:function', got {it.labeller!r}"
        )
    if not cfg.data.eval:
        raise ConfigError(
            "data.eval: required by iterate (the held-out prompts of each round's pairs and gold)"
        )
    if cfg.reward.function:
        raise ConfigError("reward.function: iterate scores PPO with the reward model it trains")
    stand_in = dataclasses.replace(cfg.model, reward=cfg.model.reward or cfg.model.policy)
    derived = dataclasses.replace(cfg, model=stand_in)
    for stage in ("rm", "ppo", "eval"):
        validate(derived, stage, world_size)
