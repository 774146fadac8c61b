#!/usr/bin/env bash
# Debian's Chromium, for the test that renders moe_jax.report's page in a real browser (tests/test_report.py,
# driven by playwright from the test extra). Nothing to do where /usr/bin/chromium exists; elsewhere it needs
# root and apt (Debian / Ubuntu). Without it that one test skips, naming why (and fails under CI=true).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "install_test_browser: no apt-get or not root; install Chromium yourself to run the browser test" >&2
    exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
