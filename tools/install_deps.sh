#!/usr/bin/env bash
# Installs the build dependencies from Debian packages when any is missing.
# Used by `make build` / `make run` / `make test` and CI; safe to re-run.
set -euo pipefail
pkgs=(cmake ninja-build g++ nlohmann-json3-dev libpcre2-dev libxxhash-dev libspdlog-dev libfmt-dev
      libcli11-dev libcpp-httplib-dev libboost-dev libssl-dev zlib1g-dev libbrotli-dev pkg-config libgtest-dev ccache
      python3 python3-venv python3-pip)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "installing: ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
