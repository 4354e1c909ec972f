#!/usr/bin/env bash
# Formatters and linters, configured in rustfmt.toml and pyproject.toml; run by
# ci/test.sh inside its virtualenv, before the tests, so a lint failure fails fast.
set -euo pipefail
cd "$(dirname "$0")/.."

pip install -q ruff mypy types-PyYAML
cargo fmt --check
cargo clippy --all-targets --quiet -- -D warnings
ruff check --quiet .
ruff format --check --quiet .
mypy
