#!/bin/bash
# Issue 29, item 4: does Transformer Engine 1.x build and run on the GPU machine (CUDA 13,
# torch 2.11+cu130)? The registry has TE 1.13's core only as a CUDA 12 binary
# (transformer_engine_cu12, 120 MiB, needs libcudart/libcublas .so.12, which the image lacks) and
# no source, so this builds TE 1.13 from its source: git tag v1.13 of NVIDIA/TransformerEngine with
# its pinned cudnn-frontend (commit 936021bf, headers and cmake only), core for sm_90 only, then
# the PyTorch extension, with cmake and ninja from the registry's wheels. If it builds,
# validation/te_real_run.py runs the plugin's TE backend against it. Either way it says where it stops.
# Bundle (.te1/, carried): te113-src.tar.gz, cmake-*.whl, ninja-*.whl, the pydantic wheels of
# .h200/ (and its spare typing_extensions); made on the CPU machine by
#   git -C <TE mirror> archive v1.13 | tar x -C te1src; git -C <cudnn-frontend mirror> archive
#   936021bfed8c91dc416af1588b2c4eca631a9e45 include cmake | tar x -C te1src/3rdparty/cudnn-frontend
#   tar czf te113-src.tar.gz te1src; pip download --no-deps --only-binary=:all: --python-version 3.12
#   --platform manylinux2014_x86_64 cmake ninja
# Usage (repo root): [TE1_PATCH=1] bash validation/run_te1_gpu.sh [BUILD_BUDGET_S]   (logs under $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/te1 /tmp/cudnn/lib
REPO=$PWD; B=$REPO/.te1; T0=$(date +%s); BUILD_BUDGET=${1:-450}
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvcc --version | tail -2; python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"
python3 -m pip install -q --no-index --no-deps --target /tmp/tools "$B"/cmake-*.whl "$B"/ninja-*.whl || exit 1
export PATH=/tmp/tools/bin:$PATH PYTHONPATH=/tmp/tools; cmake --version | head -1; ninja --version
# cuDNN from torch's nvidia-cudnn wheel; cudnn-frontend's cmake wants unversioned library names
CUDNN=$(python3 -c "import nvidia.cudnn as c, os; print(os.path.dirname(c.__file__) if c.__file__ else list(c.__path__)[0])")
echo "cuDNN at $CUDNN"; ls "$CUDNN" "$CUDNN"/lib | head -20
ln -sfn "$CUDNN"/include /tmp/cudnn/include
for f in "$CUDNN"/lib/libcudnn*.so.*; do b=$(basename "$f"); ln -sf "$f" /tmp/cudnn/lib/"$b"; ln -sf "$f" /tmp/cudnn/lib/"${b%%.so.*}.so"; done
tar xzf "$B"/te113-src.tar.gz -C /tmp/te1
cd /tmp/te1/te1src || exit 1
if [ "${TE1_PATCH:-0}" = 1 ]; then
  # Seen on 2026-12-06: TE 1.13's core stops at gemm/cublaslt_gemm.cu, whose atomic-GEMM block
  # (comm-GEMM overlap with userbuffers only) sets CUBLASLT_MATMUL_DESC_ATOMIC_SYNC_* attributes
  # that cuBLAS 13 no longer has. TE1_PATCH=1 compiles that block only for cuBLAS < 13 (atomic
  # GEMM then unavailable; nothing here uses it) to see how far the rest gets.
  sed -i 's/^#if CUDA_VERSION >= 12020 \&\& CUBLAS_VERSION >= 120205$/#if CUDA_VERSION >= 12020 \&\& CUBLAS_VERSION >= 120205 \&\& CUBLAS_VERSION < 130000/' \
    transformer_engine/common/gemm/cublaslt_gemm.cu
  el "patched: $(grep -c 'CUBLAS_VERSION < 130000' transformer_engine/common/gemm/cublaslt_gemm.cu) guard(s) in cublaslt_gemm.cu"
fi
rm -rf /tmp/te1site  # pip --target keeps an earlier call's files
el "building TE 1.13 (core sm_90 + PyTorch extension), budget ${BUILD_BUDGET} s"
CUDNN_PATH=/tmp/cudnn CUDNN_HOME=/tmp/cudnn NVTE_CUDA_ARCHS=90 NVTE_FRAMEWORK=pytorch MAX_JOBS=16 \
  CMAKE_POLICY_VERSION_MINIMUM=3.5 NVTE_RELEASE_BUILD=0 \
  timeout -k 10 "$BUILD_BUDGET" python3 -m pip install -v --no-index --no-deps --no-build-isolation \
  --target /tmp/te1site . > "$OUT"/te1_build.log 2>&1
RC=$?; el "build rc=$RC"
grep -nE "error|Error|FAILED|fatal" "$OUT"/te1_build.log | grep -v "Werror\|-Wno-error\|error_" | head -40 | cut -c1-400
tail -15 "$OUT"/te1_build.log | cut -c1-400
cd "$REPO"
if [ $RC -eq 0 ]; then
  # TE's recipes import pydantic (the four wheels, and typing_extensions where the image's is old)
  python3 -m pip install -q --no-index --no-deps --target /tmp/te1py "$B"/pydantic-*.whl \
    "$B"/pydantic_core-*.whl "$B"/annotated_types-*.whl "$B"/typing_inspection-*.whl
  PYTHONPATH=/tmp/te1py python3 -c "import pydantic" 2>/dev/null || python3 -m pip install -q \
    --no-index --no-deps --target /tmp/te1py "$B"/typing_extensions-*.whl
  [ "${TE1_PATCH:-0}" = 1 ] && python3 validation/te1_torch211_patch.py /tmp/te1site
  export PYTHONPATH=/tmp/te1site:/tmp/te1py:$REPO LD_LIBRARY_PATH=/tmp/cudnn/lib:$LD_LIBRARY_PATH
  python3 -c "import transformer_engine as t, transformer_engine.pytorch; print('TE', t.__version__)" 2>&1 | tail -3
  timeout -k 10 $(( 590 - ($(date +%s) - T0) )) python3 validation/te_real_run.py --out "$OUT"/te1_real 2>&1 | tail -40
fi
el done
