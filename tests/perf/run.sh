#!/usr/bin/env bash
# The stack's performance in one run, side by side: direct, proxy, swapper,
# proxy + swapper (the product), LiteLLM. On demand only (not part of pytest).
#
#   tests/perf/run.sh                       everything (~11 min on 2 cores)
#   tests/perf/run.sh --only real,swap      some workloads (see --help)
#   tests/perf/run.sh --profile             also py-spy the proxy and swapper workers
#   tests/perf/run.sh agents [--agents codex --turns 3 ...]
#                                           Claude Code / Codex turns, direct vs the
#                                           stack: prompt-cache reuse and TTFT
#                                           (tests/perf/agents.py; ~20 min on 2 cores)
#   tests/perf/run.sh thrash [--loads 3,20 --policies fifo,hold --only two,three]
#                                           several agents on several models: loads,
#                                           time against the ideal, waits, per swap
#                                           policy (tests/perf/thrash.py; ~8 min at 3 s)
#   tests/perf/run.sh fairshare [--loads 3,20 --turns 60 --answer 0.25]
#                                           three tenants (weights 1/2/3) on two models:
#                                           GPU share vs weight, load seconds charged,
#                                           makespan vs ideal; then one tenant
#                                           (tests/perf/fairshare.py; ~6 min)
#   tests/perf/run.sh prefetch [--repeats 5]  a load with its files cold / prefetched
#                                           in the page cache (tests/perf/prefetch.py)
#   tests/perf/run.sh kvswap [--sizes 8000,24000 --repeats 3]
#                                           the turn after a swap-back: never swapped,
#                                           restored, no restore (tests/perf/kvswap.py;
#                                           ~20 min on 2 cores)
#   tests/perf/run.sh kvconv [--parts table,agents]
#                                           every conversation's cache across swaps:
#                                           three conversations and a side call, the
#                                           real agents' bodies (tests/perf/kvconv.py;
#                                           ~20 min on 2 cores)
#
# Needs the test bed (tests/testbed/setup.sh: Docker engine, llama-server image,
# SmolLM2). LiteLLM and py-spy go in their own venv under the cache dir, so they
# never touch the test venv. Output: markdown tables on stdout, JSON + .md in
# $PERF_OUT (default /tmp/coding-stack-perf).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
env_file="${TESTBED_ENV:-$repo/tests/testbed/testbed.env}"
if [ ! -f "$env_file" ]; then
  echo "no test bed: run tests/testbed/setup.sh first (or set TESTBED_ENV)" >&2
  exit 2
fi
set -a
# shellcheck disable=SC1090
source "$env_file"
set +a
cache="${CODING_STACK_CACHE:-/var/cache/coding-stack}"
py="${PERF_PYTHON:-$repo/.venv/bin/python}"
[ -x "$py" ] || py=python3

# The benchmarks of their own (tests/perf/<name>.py) need neither LiteLLM nor py-spy.
case "${1:-}" in
  agents | kvswap | kvconv | thrash | fairshare | prefetch) name=$1; shift; exec "$py" -m "tests.perf.$name" "$@" ;;
esac

# LiteLLM 1.108.7 (the proxy extra) and py-spy 0.4.3, pinned, in a venv of their own.
LITELLM_VERSION=1.108.7
PYSPY_VERSION=0.4.3
venv="$cache/perf-venv-$LITELLM_VERSION-$PYSPY_VERSION"
if [ ! -x "$venv/bin/litellm" ] || [ ! -x "$venv/bin/py-spy" ]; then
  echo "[perf] installing litellm[proxy]==$LITELLM_VERSION and py-spy==$PYSPY_VERSION in $venv" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q "litellm[proxy]==$LITELLM_VERSION" "py-spy==$PYSPY_VERSION" >&2
fi

args=()
for a in "$@"; do
  if [ "$a" = "--profile" ]; then args+=(--profile "$venv/bin/py-spy"); else args+=("$a"); fi
done
exec "$py" -m tests.perf.bench --litellm "$venv/bin/litellm" ${args[@]+"${args[@]}"}
