#!/usr/bin/env bash
# Build the documentation site into site/ (open site/index.html), strictly: a broken link, a
# page missing from the navigation, or a public name of hvdsync.torch / hvdsync.keras without a
# docstring or an API entry fails the build. Installs MkDocs into .venv (requirements-docs.txt)
# if needed; run scripts/setup.sh first.
#   bash scripts/docs.sh serve         serve it on :8000 instead, rebuilt on each edit
#   bash scripts/docs.sh screenshots   build, then shoot the home page, a guide and an API page
#                                      into docs/screenshots/ with headless Chromium
#                                      (Debian: apt-get install chromium)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import mkdocs, material, mkdocstrings_handlers.python, ruff" 2>/dev/null; then
  echo "[docs] installing MkDocs (requirements-docs.txt)" >&2
  .venv/bin/python -m pip install -q -r requirements-docs.txt \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi
source scripts/quiet_tf.sh
export NO_MKDOCS_2_WARNING=1  # (Material's notice about its successor)
if [ "${1:-}" = "serve" ]; then exec .venv/bin/python -m mkdocs serve; fi
if [ "${1:-}" != "screenshots" ]; then exec .venv/bin/python -m mkdocs build --strict --clean "$@"; fi
.venv/bin/python -m mkdocs build --strict --clean -q
.venv/bin/python -m http.server 8765 -d site >/dev/null 2>&1 & server=$!
trap "kill $server 2>/dev/null" EXIT
for _ in $(seq 50); do curl -sf http://localhost:8765/ >/dev/null && break; sleep 0.1; done
for page in home: guide:delay/ api:api/configs/; do
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$(mktemp -d)" --hide-scrollbars --window-size=1280,900 \
    --screenshot="docs/screenshots/${page%%:*}.png" "http://localhost:8765/${page#*:}" 2>/dev/null
done
ls -l docs/screenshots
