#!/usr/bin/env bash
# The live gate over the running stack: load each model and probe it as clients do.
#
#   ./verify.sh                     every model of the registry (each needs an entry in
#                                   scripts/verify.toml, or the gate refuses to run)
#   ./verify.sh smollm2 qwen-35b    the models named (ids or aliases)
#   ./verify.sh --no-search         without the web_search round trip
#   ./verify.sh --url http://host:11433 --json
#
# Per model: load s, TTFT, decode tok/s, and pass/FAIL with the reason for a short chat,
# a streamed chat, a tool call, n=2 and a web_search round trip (when SEARXNG_URL is
# set). Exit 0: every probe passed; 1: a probe failed; 2: refused (unknown model, no
# gate entry, no stack). PROXY_PORT, API_KEY, SEARXNG_URL come from the environment or .env.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/python.sh
. "$repo/scripts/python.sh"
run_python verify.sh verify.py "$@"
