#!/usr/bin/env bash
# Regenerates docs/report.png, the screenshot of the HTML report that README shows: runs the
# sentiment suite (builtin VADER, no network) into a temporary root and photographs the page
# `evalflow run` wrote, with headless Chromium at 1280x2000.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v chromium >/dev/null || { echo "report_screenshot: install chromium first (apt-get install chromium)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cargo run --quiet -- run pipelines/sentiment.toml --out "$tmp/sentiment" >/dev/null
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$tmp/profile" --hide-scrollbars --window-size=1280,2000 \
  --screenshot="$PWD/docs/report.png" "file://$tmp/sentiment/report.html" 2>/dev/null
echo "wrote docs/report.png"
