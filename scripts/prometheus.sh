#!/usr/bin/env bash
# A real Prometheus for the test of the Grafana dashboard (tests/e2e): Debian's package unpacked into
# .venv/prometheus (its binaries in .venv/prometheus/usr/bin, which scripts/test.sh puts on PATH), unless a
# prometheus is on PATH or unpacked already. Needs root and apt-get (for apt-get update); elsewhere it says so
# in one line and that test is skipped. It installs nothing system-wide and starts no service.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.venv/prometheus
if command -v prometheus > /dev/null || [ -x "$dest/usr/bin/prometheus" ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get > /dev/null; then
  echo "prometheus: none on PATH, and unpacking Debian's needs root and apt-get: the dashboard's test is skipped" >&2
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"  # apt-get download fetches as the _apt user where it can
if ! (cd "$tmp" && apt-get download -qq prometheus > /dev/null 2>&1); then
  apt-get update -qq > /dev/null
  (cd "$tmp" && apt-get download -qq prometheus > /dev/null 2>&1)
fi
mkdir -p "$dest"
dpkg -x "$tmp"/prometheus_*.deb "$dest"
echo "prometheus: unpacked $("$dest/usr/bin/prometheus" --version 2>&1 | head -1) into $dest"
