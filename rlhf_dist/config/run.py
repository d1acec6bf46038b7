"""Sections of how a run runs: outputs and logging (`run`), speed paths (`perf`),
distribution (`distributed`), debugging aids (`debug`) and health alerts (`alerts`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_dist.config.keys import key
from rlhf_dist.errors import ConfigError, RewardFunctionError, UserError  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = key("runs/default", "where the run writes metrics, checkpoints and final/")
    seed: int = key(0, "seed of every RNG (each rank derives its own from it)")
    log_every: int = key(1, "write a metrics row every N steps (SFT/RM) or iterations (PPO)", gt=0)
    trackers: tuple[str, ...] = key(
        (),
        "trackers besides metrics.jsonl (always written): wandb, tensorboard, trackio (its local "
        "store, $TRACKIO_DIR; the rlhf_dist[trackio] extra)",
        choices=("wandb", "tensorboard", "trackio"),
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
    eval_every: int = key(
        0,
        "evaluate on data.eval every N optimizer steps (SFT/RM/DPO/KTO) or iterations (PPO) and "
        "at the last one, logged as eval/<name> with the step (docs/metrics.md); 0 = only the "
        "stage's end-of-run evaluation",
        min=0,
    )
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
    auto_fit: bool = key(
        False,
        "at start, take the micro-batch sizes (the stage's micro_batch_size; PPO's "
        "rollout_micro_batch_size too) or token budget from the memory plan (rlhf-dist plan): "
        "the largest that fits this device; the derived config is printed and is what "
        "config.yaml records (docs/distributed.md, Planning memory)",
    )
    push_to_hub: bool = key(
        False,
        "after the final export, upload final/ (final_adapter/ as adapter/, critic/ as critic/) "
        "to the Hugging Face Hub repository run.hub_model_id; the files stay on disk",
    )
    hub_model_id: str = key("", "run.push_to_hub: the hub repository, user/name or org/name")
    hub_private: bool = key(False, "run.push_to_hub: create the repository as private")
    hub_token_env: str = key(
        "HF_TOKEN",
        "run.push_to_hub: environment variable holding the hub token (never written to any "
        "output); unset: the token of `hf auth login`",
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
class PerfConfig:
    """How fast: every speed path of rlhf_dist.engine and the distributed runtime. Each
    switch off runs the plain reference computation, which gives the same results within
    the tolerance its test states (tests/unit/test_unit_perf_switches.py); measured gains
    are in docs/benchmarks.md."""

    logprob_chunk_tokens: int = key(
        512,
        "tokens whose vocabulary-wide logits are computed at once when log-probs and "
        "entropies are taken (rollout scoring, the PPO update, SFT, DPO/KTO, eval), logits "
        "recomputed in backward: the (tokens, vocabulary) logits never exist, the extra "
        "memory is one (2, logprob_chunk_tokens, vocabulary) fp32 workspace; 0 = off (the "
        "whole logits at once, the reference)",
        min=0,
    )
    packed_sequences: bool = key(
        False,
        "padding-free whole-sequence forwards: each forward's rows (log-probs in rollout "
        "scoring, the PPO update, SFT, DPO/KTO and eval; critic, reward-model and RM "
        "training values) have their real tokens packed into rows no longer than the padded "
        "ones (first-fit decreasing; flash_attention_2: one row), position ids restarting "
        "per sequence, outputs mapped back. Needs a model whose masks come from "
        "transformers' masking_utils (Llama, Qwen, Mistral, Gemma, GPT-2; others are "
        "refused at load): eager/sdpa get a block-diagonal causal mask (on CPU it can cost "
        "what the padding did), flash_attention_2 its varlen kernels. Generation is never "
        "packed",
    )
    shared_prompt_forward: bool = key(
        True,
        "rollout forwards run each distinct prompt once: generation's prefill, rollout "
        "scoring (actor and reference log-probs) and the PPO update's actor forward run the "
        "prompts, deduplicated, with a KV cache indexed out to every row of the prompt's "
        "group, then the responses on it: with ppo.samples_per_prompt = n the prompt tokens "
        "cost 1/n. Gradients of a shared prompt sum over its group. Not under gradient "
        "checkpointing (no KV cache there), for forwards perf.packed_sequences packs, nor in "
        "the ZeRO-3 update (DeepSpeed takes each parameter's gradient once per backward)",
    )
    packed_linears: bool = key(
        True,
        "CPU decoding: every fp32 linear layer computes from a copy of its weight that MKL "
        "packed once per generate call for the batch's row count, instead of MKL packing "
        "it again in every call (not under autocast, for ZeRO-3 partitioned weights, "
        "without MKL, or above 2 GiB of linear weights)",
    )
    grouped_kv_attention: bool = key(
        True,
        "CPU attention (sdpa) takes grouped-query K/V heads as they are instead of "
        "transformers copying each KV head once per query head (the whole KV cache, every "
        "layer, in every decode step)",
    )
    old_logprobs_from_update: bool = key(
        True,
        "with one optimizer step per rollout (ppo.ppo_epochs=1, one minibatch) and the KL "
        "in the loss, the rollout skips the actor's scoring pass: the update's forward, "
        "detached, gives the old log-probs (ratio 1 exactly), as TRL does; off: always the "
        "scoring pass",
    )
    retain_host_memory: bool = key(
        True,
        "CPU runs: glibc's malloc keeps freed host memory in the process for the next "
        "tensor (no mmap, no trim) instead of handing every large block back to the OS, "
        "whose fresh pages then fault in one by one; the resident size stays at the run's "
        "peak. false: glibc's defaults",
    )
    num_threads: int = key(
        0,
        "CPU threads per process; 0 = the machine's cores divided among the local ranks "
        "(oversubscribed OpenMP threads spin-wait), or a single process's OMP_NUM_THREADS "
        "where it is set",
        min=0,
    )
    gather_for_generation: bool = key(
        True,
        "under ZeRO-3, gather the actor's full weights once per rollout for generation "
        "(needs memory for one full copy); off: generate through ZeRO-3's per-layer gathers, "
        "ranks kept in step by one flag all-reduce per token",
    )
    gather_for_training: str = key(
        "auto",
        "under ZeRO-3, gather the trained model's full weights once per optimizer step "
        "(one collective, ZeRO-3's per-module hooks off; gradients and optimizer states stay "
        "partitioned) instead of per layer in every forward and backward; auto = when a "
        "full copy takes at most a quarter of the free memory (printed); never = off",
        choices=("auto", "always", "never"),
    )

    @classmethod
    def reference(cls) -> PerfConfig:
        """Every speed path off: the plain computation the switches are tested against."""
        return cls(
            logprob_chunk_tokens=0, packed_sequences=False, shared_prompt_forward=False,
            packed_linears=False, grouped_kv_attention=False, old_logprobs_from_update=False,
            retain_host_memory=False, gather_for_generation=False, gather_for_training="never",
        )  # fmt: skip


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
    timeout_s: int = key(
        1800,
        "seconds a collective waits for the other ranks before the run fails with an error",
        gt=0,
    )
    sequence_parallel_size: int = key(
        1,
        "Ulysses sequence parallelism: this many consecutive ranks split every training "
        "forward's sequences (SFT, DPO/IPO/SimPO/ORPO, KTO, the GRPO/RLOO/REINFORCE++ update "
        "and rollout scoring) by columns, all-to-all around attention, so each holds 1/n of "
        "the activations; must divide the world size and the model's attention heads (not "
        "rm, critics, online DPO, PPO-ptx); generation, reward models and evaluation run "
        "whole; 1 = off",
        gt=0,
    )
