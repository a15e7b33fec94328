#!/bin/bash
# Final device call (see /work/shared/gpu/README.md): join the TE core wheel whose first parts were
# copied to /tmp/te by earlier calls, install TE 2.20.2, build its PyTorch extension, and - while it
# builds - run the Triton kernel GPU tests; then the transpose benchmark and the real-TE checks.
# Usage (repo root, .te/final carried): bash validation/run_te.sh   (writes logs under $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/te /tmp/tebuild
REPO=$PWD
T0=$(date +%s)
cp .te/final/te_cu13.part4 /tmp/te/
ls -la /tmp/te
cat /tmp/te/te_cu13.part0 /tmp/te/te_cu13.part1 /tmp/te/te_cu13.part2 /tmp/te/te_cu13.part3 /tmp/te/te_cu13.part4 \
  > /tmp/te/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
echo "sha256 want $(cat .te/final/cu13.sha256)"
echo "sha256 got  $(sha256sum /tmp/te/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl | cut -c1-64)"
{
  python3 -m pip install -q --no-index --no-deps --target /tmp/site \
    /tmp/te/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl \
    .te/final/transformer_engine-2.20.2-py3-none-any.whl &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site3 \
    .te/final/pydantic-*.whl .te/final/pydantic_core-*.whl .te/final/annotated_types-*.whl .te/final/typing_inspection-*.whl &&
  tar xzf .te/final/transformer_engine_torch-2.20.2.tar.gz -C /tmp/tebuild &&
  cd /tmp/tebuild/transformer_engine_torch-2.20.2 &&
  PYTHONPATH=/tmp/site MAX_JOBS=16 NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch \
    python3 -m pip install --no-index --no-deps --no-build-isolation --target /tmp/site2 . &&
  cp /tmp/site2/transformer_engine/wheel_lib/transformer_engine_torch.cpython-312-x86_64-linux-gnu.so \
     /tmp/site/transformer_engine/wheel_lib/ && echo TE_BUILD_OK
} > /tmp/te_build.log 2>&1 &
BUILD_PID=$!
cd "$REPO"
PYTHONPATH=$REPO timeout 240 python3 -m pytest tests/test_kernels.py -q -m gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/kernel_tests.log"
wait $BUILD_PID; echo "build rc=$? after $(( $(date +%s) - T0 )) s"
tail -25 /tmp/te_build.log > "$OUT/te_build_tail.log"; tail -3 /tmp/te_build.log
PYTHONPATH=$REPO timeout 200 python3 benchmarks/bench_transpose.py --sweep --reps 30 \
  --out "$OUT/transpose_h200.md" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"; tail -12 "$OUT/bench.log"
export PYTHONPATH=/tmp/site:/tmp/site3:$REPO
python3 -c "import transformer_engine.pytorch as te, transformer_engine; print('TE', transformer_engine.__version__)" 2>&1 | tail -3
timeout 240 python3 validation/te_real_run.py --out "$OUT" 2>&1 | grep -v "DeprecationWarning\|warnings.warn" | tee "$OUT/te_real_run.log"
echo "total $(( $(date +%s) - T0 )) s"
