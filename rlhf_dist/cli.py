"""`rlhf-dist {sft,rm,ppo,grpo,dpo,kto,eval,iterate,demo,report,config,plan,serve}`: the command line, a thin
layer over the Python API (rlhf_dist/api.py).

A user mistake (bad config, missing file, wrong data) ends as one line on stderr and
exit status 2, never a traceback. Heavy imports happen after argument parsing so that
`--help` and config errors are instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

from rlhf_dist.config import Config  # the section names for --help (config is torch-free)
from rlhf_dist.config.presets import PRESETS, stage_and_preset
from rlhf_dist.errors import ConfigError, Preempted, ServerError, TrainingDiverged, UserError
from rlhf_dist.names import DEMO_ALGORITHMS, DEMO_ITERATIVE

SECTIONS = [f.name for f in dataclasses.fields(Config)]

STAGES = {  # name -> help text; the runners are rlhf_dist.api.RUNNERS
    "sft": "supervised fine-tuning on prompt/response data",
    "rm": "train a Bradley-Terry reward model on preference pairs",
    "ppo": "PPO against a reward model or reward function (--preset grpo, dapo, ...: the "
    "critic-free methods)",
    "grpo": "GRPO: rlhf-dist ppo with the grpo preset (docs/grpo.md); every key you set wins",
    "dpo": "DPO / conservative DPO / IPO on preference pairs (no reward model, no sampling)",
    "kto": "KTO on desirable / undesirable completions (or preference pairs)",
    "eval": "score a policy on held-out prompts; KL to a reference",
    "iterate": "iterative RLHF: rounds of sample pairs -> label -> reward model -> PPO",
}

EPILOG = (
    "Overrides are section.key=value pairs applied after --config, e.g. ppo.kl_coef=0.1 "
    "run.output_dir=runs/x. `rlhf-dist config [SECTION]` lists every key with its type, "
    "default and meaning."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf-dist", description="RLHF: SFT -> reward model -> PPO."
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{sft,rm,ppo,grpo,dpo,kto,eval,iterate,demo,report,config,plan,serve}",
    )
    _add_stages(sub)
    _add_demo(sub)
    _add_report_and_config(sub)
    _add_plan(sub)
    _add_serve(sub)
    return parser


def _add_stages(sub: argparse._SubParsersAction) -> None:
    """One subcommand per stage runner: --config, --resume (not eval), overrides."""
    for name, help_text in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EPILOG)
        p.add_argument(
            "--config",
            help=f"YAML config file (sections: {', '.join(SECTIONS)}; see `rlhf-dist config`)",
        )
        if name != "eval":
            p.add_argument(
                "--resume",
                metavar="auto|PATH",
                help="continue from the latest checkpoint in run.output_dir (auto) or from PATH",
            )
        if name == "ppo":
            p.add_argument(
                "--preset",
                choices=tuple(PRESETS),
                help="the keys of a named method under your config (docs/grpo.md): "
                + ", ".join(PRESETS),
            )
        p.add_argument("overrides", nargs="*", help="section.key=value overrides")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="offline end-to-end demo: SFT -> RM -> PPO -> eval on a generated task",
        description="Generate the offline 'reviews' task, then run SFT -> RM -> PPO -> eval on tiny models.",
    )
    demo.add_argument(
        "--output-dir", default="runs/demo", help="where every stage writes (default runs/demo)"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--algorithm",
        default=None,
        choices=DEMO_ALGORITHMS,
        help="the alignment stage: ppo (the reviews task's default; the other tasks run "
        "grpo) or a critic-free estimator (grpo, rloo, "
        "reinforce_pp, reinforce_pp_baseline): SFT -> RM -> it -> eval; dpo / kto / simpo / "
        "orpo: SFT -> DPO, KTO, SimPO or ORPO on the preference pairs -> eval; iterative: "
        "SFT -> 2 rounds of rlhf-dist iterate",
    )
    demo.add_argument(
        "--task",
        default="reviews",
        choices=("reviews", "tool_use", "arithmetic", "vision"),
        help="reviews (default): the generated reviews task; tool_use: SFT -> GRPO with a "
        "lookup tool -> eval on a task whose answers only the tool knows (--algorithm grpo; "
        "docs/agents.md); arithmetic: the real SmolLM2-135M-Instruct (PyPI) evaluated, GRPO "
        "on reasoning-gym's chain_sum, evaluated again (--algorithm grpo; docs/demo.md); "
        "vision: a tiny Qwen2-VL, SFT on a small labelled subset of a colour-of-the-shape "
        "image task -> GRPO, held-out accuracy before and after (--algorithm grpo; "
        "docs/vision.md)",
    )
    demo.add_argument(
        "--quick", action="store_true", help="a much shorter run (smoke test, not aligned)"
    )
    demo.add_argument(
        "--moe",
        action="store_true",
        help="--task reviews: the policy a tiny mixture of experts (Qwen3-MoE, 4 experts, "
        "top-2, its load-balancing loss on; docs/moe.md)",
    )
    demo.add_argument(
        "--through-endpoint",
        action="store_true",
        help="--task tool_use: GRPO's environment drives the policy through a rollout "
        "server's OpenAI-compatible chat endpoint (a `rlhf-dist serve` process started for it)",
    )
    demo.add_argument(
        "--verifiers",
        action="store_true",
        help="--task tool_use: as --through-endpoint, the environment being the task written "
        "as a verifiers ToolEnv (rlhf_dist/demo/tool_verifiers.py; needs the verifiers package)",
    )
    demo.add_argument(
        "--served",
        action="store_true",
        help="--task tool_use: GRPO's turns sampled by a `rlhf-dist serve` process started "
        "for it, the tool run in this process (what ppo.max_staleness=k needs)",
    )
    demo.add_argument(
        "overrides",
        nargs="*",
        help="section.key=value overrides applied to every stage they concern "
        "(e.g. generation.backend=vllm)",
    )


def _add_report_and_config(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser(
        "report",
        help="PNG plots and an HTML page of a run (or of a directory of runs, e.g. the demo's)",
        description="Plot metrics, distributions, alerts and samples of PATH (a run's output_dir, "
        "or a directory whose subdirectories are runs) into PATH/report/index.html.",
    )
    report.add_argument("path", metavar="PATH", help="a run's output_dir or a directory of runs")
    report.add_argument(
        "--output", metavar="DIR", help="where the page and PNGs go (default PATH/report)"
    )
    config = sub.add_parser(
        "config",
        help="list the config keys: section.key, type, default, meaning",
        description="Print every config key of SECTION (all sections without one) as "
        "section.key, its type, default, choices or range, and meaning.",
    )
    config.add_argument(
        "section",
        nargs="?",
        default="",
        help="a section (ppo), subsection (ppo.optim) or key; or a preset (grpo, dapo, ...): "
        "every key it reads, with its values (no critic key for a critic-free one)",
    )
    config.add_argument(
        "--yaml",
        metavar="STAGE",
        choices=(*STAGES, *PRESETS),
        help="write a starter config for STAGE (a stage or a preset, e.g. grpo) to stdout: "
        "every key it reads with its value and help as comments",
    )


def _add_plan(sub: argparse._SubParsersAction) -> None:
    text = (
        "the per-rank memory peak of each phase of a stage (generation, scoring, update) "
        "and its terms, from the models' config.json alone (no data or reward is needed); "
        "exit 2 with the change to make when it does not fit (docs/distributed.md, Planning "
        "memory)"
    )
    p = sub.add_parser("plan", help=text, description=text, epilog=EPILOG)
    p.add_argument("--config", help="YAML config file of the run to plan")
    p.add_argument(
        "--stage",
        default="ppo",
        choices=("sft", "rm", "ppo", "grpo", "dpo", "kto"),
        help="the stage (default ppo)",
    )
    p.add_argument("--preset", choices=tuple(PRESETS), help="as rlhf-dist ppo --preset")
    p.add_argument("--gpus", type=int, default=1, help="ranks (GPUs) of the launch (default 1)")
    p.add_argument(
        "--gpu-memory", default="80GiB", help="memory per GPU: 80GiB, 80GB (10^9) (default 80GiB)"
    )
    p.add_argument(
        "--zero-stage",
        default="auto",
        choices=("auto", "none", "0", "1", "2", "3"),
        help="DeepSpeed ZeRO stage of the accelerate config; none = no DeepSpeed; auto = 3 "
        "with several GPUs, none with one",
    )
    p.add_argument(
        "--engine",
        default="deepspeed",
        choices=("deepspeed", "fsdp2"),
        help="the sharding engine of the accelerate config: deepspeed (with --zero-stage) or "
        "fsdp2 (distributed_type FSDP, fsdp_version 2; --offload all = fsdp_offload_params)",
    )
    p.add_argument(
        "--offload",
        default="none",
        choices=("none", "optimizer", "all"),
        help="DeepSpeed offload to CPU memory: the optimizer states, or (ZeRO-3) the weights too",
    )
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")


def _run_plan(args: argparse.Namespace) -> int:
    from rlhf_dist.config import load_config
    from rlhf_dist.planning import cli_plan

    stage, preset = stage_and_preset(args.stage, args.preset)
    cfg = load_config(args.config, list(args.overrides), preset)
    table = cli_plan(
        cfg,
        stage,
        args.gpus,
        args.gpu_memory,
        args.zero_stage,
        args.offload,
        args.device,
        args.engine,
    )
    _print_out(table)
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    text = (
        "the rollout server: model.policy's generation behind HTTP, weights synced from a "
        "trainer (generation.backend=server; docs/serving.md)"
    )
    serve = sub.add_parser("serve", help=text, description=text, epilog=EPILOG)
    serve.add_argument("--config", help="YAML config file (model, generation, serve, perf)")
    serve.add_argument("overrides", nargs="*", help="section.key=value overrides")


def _run_serve(args: argparse.Namespace) -> int:
    from rlhf_dist.config import check_keys, load_config

    cfg = load_config(args.config, list(args.overrides))
    check_keys(cfg)  # before torch loads: config errors are instant
    from rlhf_dist.serving.main import serve

    serve(cfg)
    return 0


def _run_stage(name: str, args: argparse.Namespace) -> int:
    from rlhf_dist.config import load_config, validate
    from rlhf_dist.config.paths import check_stage_inputs

    overrides = list(args.overrides) + (
        [f"run.resume={args.resume}"] if getattr(args, "resume", None) else []
    )
    stage, preset = stage_and_preset(name, getattr(args, "preset", None))
    # before torch loads: config errors, missing models and empty data files are instant
    cfg = load_config(args.config, overrides, preset)
    validate(cfg, stage, int(os.environ.get("WORLD_SIZE", "1")))  # the config, then its files
    check_stage_inputs(cfg, stage)
    from rlhf_dist import api

    api.run_validated(stage, cfg)  # validated once: here, before torch loads
    api.close()
    return 0


DUPLICATE_ERROR_GRACE_S = 3.0


def _duplicate_error() -> bool:
    """True on every rank but a machine's first while no process group exists yet.

    Until the ranks can talk, each one checks the same command line and files on its own
    and raises the same error; one line per machine is enough (each machine may see its
    own files). Once they can talk, an error may be one rank's alone, so every rank prints.
    """
    dist = sys.modules.get("torch.distributed")  # not imported: no process group either
    if dist is not None and dist.is_available() and dist.is_initialized():
        return False
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) != 0


def _print_out(text: object) -> None:
    """Print to stdout, where a reader that stopped early (`rlhf-dist config | head`) is
    not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would fail again flushing stdout at exit: point it at /dev/null instead.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def demo_algorithm(args: argparse.Namespace) -> str:
    """`--algorithm`, or the task's own method when it is not given: PPO for the reviews
    task, GRPO for the others (the only one they run)."""
    return args.algorithm or ("ppo" if args.task == "reviews" else "grpo")


def _run_demo(args: argparse.Namespace) -> int:
    """`rlhf-dist demo`: the task's pipeline (demo/), one process."""
    from rlhf_dist.demo.pipeline import run_demo

    args = argparse.Namespace(**(vars(args) | {"algorithm": demo_algorithm(args)}))
    if args.moe and (args.task != "reviews" or args.algorithm in DEMO_ITERATIVE):
        raise ConfigError("--moe: with --task reviews and a one-stage --algorithm only")
    if args.task == "tool_use":
        from rlhf_dist.demo.tool_demo import run_tool_demo

        if args.algorithm != "grpo":
            raise ConfigError("--task tool_use: runs with --algorithm grpo only")
        modes = {"verifiers": args.verifiers, "function": args.through_endpoint}
        endpoint = next((m for m, on in (modes | {"served": args.served}).items() if on), "")
        run_tool_demo(args.output_dir, args.seed, args.quick, tuple(args.overrides), endpoint)
        return 0
    if args.through_endpoint or args.verifiers or args.served:
        raise ConfigError("--through-endpoint, --verifiers, --served: with --task tool_use only")
    if args.task == "vision":
        from rlhf_dist.demo.vision_demo import run_vision_demo

        if args.algorithm != "grpo":
            raise ConfigError("--task vision: runs with --algorithm grpo only")
        run_vision_demo(args.output_dir, args.seed, args.quick, tuple(args.overrides))
        return 0
    if args.task == "arithmetic":
        from rlhf_dist.demo.arithmetic_demo import run_arithmetic_demo

        if args.algorithm != "grpo":
            raise ConfigError("--task arithmetic: runs with --algorithm grpo only")
        run_arithmetic_demo(args.output_dir, args.seed, args.quick, tuple(args.overrides))
        return 0
    if args.algorithm in DEMO_ITERATIVE:
        from rlhf_dist.demo.iterative import run_iterative_demo

        run_iterative_demo(args.output_dir, args.seed, args.quick, tuple(args.overrides))
        return 0
    run_demo(
        args.output_dir, args.seed, args.quick, args.algorithm, tuple(args.overrides), args.moe
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return _run_demo(args)
        if args.command == "report":
            from rlhf_dist.observability.report import build_report

            _print_out(build_report(args.path, args.output))
            return 0
        if args.command == "config":
            from rlhf_dist.config import describe, starter_yaml
            from rlhf_dist.config.views import describe_view, is_view

            if args.yaml:
                _print_out(starter_yaml(args.yaml))
            elif is_view(args.section):
                _print_out(describe_view(args.section))
            else:
                _print_out(describe(args.section))
            return 0
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "serve":
            return _run_serve(args)
        return _run_stage(args.command, args)
    except UserError as e:
        if not _duplicate_error():
            message = " ".join(str(e).split())  # one line, whatever the message held
            print(f"rlhf-dist {args.command}: error: {message}", file=sys.stderr)
        else:
            # The launcher stops every rank once one exits: leave the machine's first rank,
            # which meets the same error about now, the time to print the line.
            time.sleep(DUPLICATE_ERROR_GRACE_S)
        return 2
    except TrainingDiverged as e:
        print(f"rlhf-dist {args.command}: stopped: {e}", file=sys.stderr)
        return 3
    except Preempted as e:
        print(f"rlhf-dist {args.command}: {e}", file=sys.stderr)
        return 0
    except ServerError as e:
        print(f"rlhf-dist {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 4
    except RuntimeError as e:
        from rlhf_dist.distributed import collective_failure

        failure = collective_failure(e)
        if failure is None:
            raise
        print(f"rlhf-dist {args.command}: error: {failure}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        print(f"rlhf-dist {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> int:
    """`rlhf-dist` and `python -m rlhf_dist`: main(), then the end of the process
    (api.end_process: one that made a gloo group leaves without the interpreter's teardown,
    which can abort or hang it after its work is done). An error no handler in main()
    took is printed as Python would, with exit status 1; a failed command leaves without
    the closing barrier (api.close), so its launcher stops the other ranks at once."""
    try:
        code = main()
    except Exception:
        traceback.print_exc()
        code = 1
    from rlhf_dist import api

    if code != 0:
        api.close(failed=True)  # no closing barrier: this rank may have failed alone
    return api.end_process(code)


if __name__ == "__main__":
    sys.exit(entry())
