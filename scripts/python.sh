# Sourced by the top-level scripts: run_python NAME SCRIPT ARGS... execs
# scripts/SCRIPT with a Python >= 3.11 (tomllib), preferring the repo's venv;
# without one it says so as NAME and exits 2.
run_python() {
  local name="$1" script="$2" repo cand
  shift 2
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  for cand in "$repo/.venv/bin/python" python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      exec "$cand" "$repo/scripts/$script" "$@"
    fi
  done
  echo "$name: needs Python 3.11 or newer (python3)" >&2
  exit 2
}
