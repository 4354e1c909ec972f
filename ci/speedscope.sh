#!/usr/bin/env bash
# speedscope's own app (its npm release) into .cache/speedscope, to open our speedscope
# files in the browser; ci/test.sh and ci/matrix.sh each call it, so either runs alone.
set -euo pipefail
cd "$(dirname "$0")/.."

SPEEDSCOPE_VERSION=1.25.0
[ "$(cat .cache/speedscope/version 2>/dev/null)" == "$SPEEDSCOPE_VERSION" ] && exit 0
if ! command -v npm >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
fi
rm -rf .cache/speedscope && mkdir -p .cache/speedscope
(cd .cache/speedscope && npm pack --silent "speedscope@$SPEEDSCOPE_VERSION" >/dev/null && tar xzf speedscope-*.tgz)
echo "$SPEEDSCOPE_VERSION" >.cache/speedscope/version
