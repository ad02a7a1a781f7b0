# Sourced by the top-level scripts: run_python NAME SCRIPT ARGS... execs
# scripts/SCRIPT, and run_module NAME MODULE ARGS... execs `python -m MODULE`
# (a module of this repository), with a Python >= 3.11 (tomllib), preferring the
# repo's venv; without one it says so as NAME and exits 2.
_python_for() {
  local name="$1" repo="$2" cand
  for cand in "$repo/.venv/bin/python" python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$cand"
      return 0
    fi
  done
  echo "$name: needs Python 3.11 or newer (python3)" >&2
  exit 2
}

run_python() {
  local name="$1" script="$2" repo py
  shift 2
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  py="$(_python_for "$name" "$repo")" || exit 2
  exec "$py" "$repo/scripts/$script" "$@"
}

run_module() {
  local name="$1" module="$2" repo py
  shift 2
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  py="$(_python_for "$name" "$repo")" || exit 2
  PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m "$module" "$@"
}
