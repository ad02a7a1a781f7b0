#!/usr/bin/env bash
# The one test command: lay the test bed when needed (idempotent, cached), then
# run pytest with the test bed's variables. Extra arguments go to pytest:
#   tests/run.sh                       everything
#   tests/run.sh tests/unit -q         a part
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash tests/testbed/setup.sh
# shellcheck disable=SC1091
source tests/testbed/testbed.env
exec .venv/bin/python -m pytest "$@"
