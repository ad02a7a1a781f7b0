#!/usr/bin/env bash
# TTFT, decode tok/s and prefill tok/s of a model from streamed requests, median of runs.
#
#   ./benchmark.sh                       the default model, through the stack (:11433)
#   ./benchmark.sh --model qwen-38-27b   a model by id or alias (loads it if needed)
#   ./benchmark.sh --direct              the resident backend on its published port (:18080)
#   ./benchmark.sh --runs 10 --json      more runs, machine-readable
#   ./benchmark.sh --url http://127.0.0.1:8080   any OpenAI-compatible server
#
# Run it once through the stack and once with --direct to see what the stack adds.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="python3"
[ -x "$repo/.venv/bin/python" ] && py="$repo/.venv/bin/python"
exec "$py" "$repo/scripts/benchmark.py" "$@"
