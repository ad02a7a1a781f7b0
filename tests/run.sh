#!/usr/bin/env bash
# The one test command: lay the test bed when needed (idempotent, cached), then
# run pytest with the test bed's variables. Extra arguments go to pytest:
#   tests/run.sh                       everything
#   tests/run.sh tests/unit -q         a part
# The whole suite (no path given) runs its test files on TEST_WORKERS pytest-xdist
# workers (default 3, more than the test machine's 2 cores: most of a test's time is
# waiting on a backend, a load or a client's timer; 0: one process), a file's tests
# in one worker so its module-scoped stack is started once; each file's stack has
# its own name, ports and containers. A part runs in one process unless
# TEST_WORKERS is set.
# A selection made only of paths under tests/unit needs no Docker test bed: only
# the test venv is laid then (issue 34, part 6).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

# Unit-only when at least one argument names an existing path and every such path
# lies under tests/unit (an option's value that is no path, -k/-m, is ignored).
unit_only=0
for a in "$@"; do
  p="${a%%::*}"
  case "$a" in -*) continue ;; esac
  [ -e "$p" ] || continue
  case "$(realpath -m "$p")/" in
    "$repo/tests/unit/"*) unit_only=1 ;;
    *) unit_only=0; break ;;
  esac
done

if [ "$unit_only" = 1 ]; then
  bash tests/testbed/setup.sh venv
else
  bash tests/testbed/setup.sh
fi
if [ "$unit_only" = 0 ] || [ -f tests/testbed/testbed.env ]; then
  # shellcheck disable=SC1091
  source tests/testbed/testbed.env
fi
any_path=0
for a in "$@"; do
  case "$a" in -*) continue ;; esac
  [ -e "${a%%::*}" ] && any_path=1
done
workers="${TEST_WORKERS:-}"
[ -z "$workers" ] && [ "$any_path" = 0 ] && workers=3
if [ -n "$workers" ] && [ "$workers" != 0 ]; then
  # In collection order (tests/conftest.py puts the longest files first), not
  # xdist's default of the files with the most tests first, which put the
  # few-test, minutes-long files (the verify gate, compose) last: one worker ran
  # them alone at the end.
  set -- -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
exec .venv/bin/python -m pytest "$@"
