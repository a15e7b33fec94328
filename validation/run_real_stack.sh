#!/bin/bash
# One device call (see benchmarks/results/real_stack_h200.md): install Transformer Engine 2.20.2
# (its core library with only the sm_90 cubins kept, validation/strip_fatbin.py, so all of TE travels
# in one call), megatron-core 0.16.1 and nemo_toolkit 2.3.3 from .h200/ (carried); build TE's
# PyTorch extension and Apex's three extensions side by side; run the real-stack harnesses.
# Usage (repo root, .h200 carried):
#   bash validation/run_real_stack.sh [mcore|apex|all|graphs|verify|apex1mb|forcedsync]; logs under $OUT
# forcedsync: evaluation with a forced all-gather after every step, optimizer-step all-gather, on
#   megatron-core 0.16.1 then 0.19.2 (.h200/mc19/megatron_core-0.19.2-*.whl); then one plain mcore run
# graphs: tests/test_cuda_graphs_gpu.py (while TE builds), validation/te_cuda_graph_probe.py, one mcore run
# verify: the plugin's verify mode on real TE (probe --verify-only; one mcore run, verify every step)
# apex1mb: the Apex path with bucket_cap_mb=1, so both data-parallel shards hold real parameters
# blockwise: TE Float8BlockScaling (Float8BlockwiseQTensor weights) on megatron-core 0.19.2
#   (.h200/mc19/), again with verify mode every step, then on 0.16.1 while time is left
#
# .h200/ (44 MiB; `echo /.h200/ >> .git/info/exclude`) is made on the CPU machine:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     transformer-engine-cu13==2.20.2 transformer-engine==2.20.2 megatron-core==0.16.1 \
#     nemo_toolkit==2.3.3 hydra-core==1.3.2 omegaconf==2.3.0 pydantic pydantic-core annotated-types \
#     typing-inspection;  pip wheel --no-deps antlr4-python3-runtime==4.9.3 wget==3.2
#   the core wheel minus its library -> .h200/tecore/<same file name> (zip -d ... libtransformer_engine.so);
#   python3 validation/strip_fatbin.py libtransformer_engine.so libte_sm90.so --keep-sm 90, then gzip it
#   (.h200/libte_sm90.so.gz) and its sha256 (.h200/libte_sm90.sha256); the other wheels, and from
#   /work/shared/gpu apex-src.tar.gz, apex_setup_min.py, transformer_engine_torch-2.20.2.tar.gz.
set -o pipefail
export PYTHONUNBUFFERED=1 NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/rs
REPO=$PWD; H=$REPO/.h200; T0=$(date +%s); WHAT=${1:-all}
case $WHAT in mcore|graphs|verify|forcedsync|blockwise) TE_ONLY=1;; *) TE_ONLY=0;; esac  # no Apex build: all cores to TE
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  "$H"/tecore/*.whl "$H"/transformer_engine-2.20.2-py3-none-any.whl "$H"/megatron_core-*.whl \
  "$H"/nemo_toolkit-*.whl || exit 1
gunzip -c "$H"/libte_sm90.so.gz > /tmp/site/transformer_engine/wheel_lib/libtransformer_engine.so
echo "libtransformer_engine.so sha256 want $(cat "$H"/libte_sm90.sha256)"
echo "libtransformer_engine.so sha256 got  $(sha256sum /tmp/site/transformer_engine/wheel_lib/libtransformer_engine.so | cut -c1-64)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site3 "$H"/pydantic-*.whl \
  "$H"/pydantic_core-*.whl "$H"/annotated_types-*.whl "$H"/typing_inspection-*.whl \
  "$H"/hydra_core-*.whl "$H"/omegaconf-*.whl "$H"/antlr4_python3_runtime-*.whl "$H"/wget-*.whl
(mkdir -p /tmp/tebuild && tar xzf "$H"/transformer_engine_torch-2.20.2.tar.gz -C /tmp/tebuild &&
 cd /tmp/tebuild/transformer_engine_torch-2.20.2 &&
 PYTHONPATH=/tmp/site MAX_JOBS=$([ $TE_ONLY = 1 ] && echo 16 || echo 10) NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch \
   python3 -m pip install --no-index --no-deps --no-build-isolation --target /tmp/site2 . &&
 cp /tmp/site2/transformer_engine/wheel_lib/transformer_engine_torch.cpython-312-x86_64-linux-gnu.so \
   /tmp/site/transformer_engine/wheel_lib/ && echo TE_BUILD_OK) > /tmp/te_build.log 2>&1 &
TE_PID=$!
[ $TE_ONLY = 1 ] || (mkdir -p /tmp/apex && tar xzf "$H"/apex-src.tar.gz -C /tmp/apex && cp "$H"/apex_setup_min.py /tmp/apex/ &&
 cd /tmp/apex && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=6 python3 apex_setup_min.py build_ext --inplace &&
 echo APEX_BUILD_OK) > /tmp/apex_build.log 2>&1 &
APEX_PID=$!
if [ "$WHAT" = graphs ]; then  # needs no TE: runs while TE builds
  PYTHONPATH=$REPO timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_graphs_gpu.py \
    > /tmp/rs/cuda_graphs_pytest.log 2>&1; el "pytest test_cuda_graphs_gpu.py rc=$?"
  tail -25 /tmp/rs/cuda_graphs_pytest.log | cut -c1-400
fi
wait $TE_PID; el "TE extension build rc=$?"; tail -2 /tmp/te_build.log
export PYTHONPATH=/tmp/site:/tmp/site3:$REPO
python3 -c "import torch, transformer_engine as t, transformer_engine.pytorch, megatron.core as m; print('torch', torch.__version__, 'TE', t.__version__, 'megatron-core', m.__version__, torch.cuda.get_device_name(0))" 2>&1 | tail -2
# Why the harness does not wrap chunks in megatron-core's Float16Module (it calls module.bfloat16()):
python3 - > /tmp/rs/float16module_probe.log 2>&1 <<'PY'
import torch, transformer_engine.pytorch as te
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer import TransformerConfig
with te.fp8_model_init(enabled=True):
    lin = te.Linear(256, 256, bias=False, params_dtype=torch.bfloat16)
cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, bf16=True)
print("before Float16Module:", type(lin.weight).__name__, "after:", type(Float16Module(cfg, lin).module.weight).__name__)
PY
tail -1 /tmp/rs/float16module_probe.log
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  el "start $name"
  timeout "$limit" "$@" --out /tmp/rs/"$name" > /tmp/rs/"$name".log 2>&1; local rc=$?
  grep -E "^\[(PASS|FAIL)\]|^SUMMARY|^losses|ranks failed" /tmp/rs/"$name".log | cut -c1-600
  el "end $name rc=$rc"
  cp /tmp/te_build.log /tmp/apex_build.log /tmp/rs/ 2>/dev/null
  tar czf "$OUT"/real_stack.tar.gz -C /tmp rs  # what comes back even if the call is cut short
}
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }  # true while fewer than $1 s have passed
finish() { tar czf "$OUT"/real_stack.tar.gz -C /tmp rs; el "done"; exit 0; }  # a mode's last step
apex_ready() {
  [ -n "$APEX_READY" ] && return 0
  wait $APEX_PID; el "apex build rc=$?"; tail -2 /tmp/apex_build.log
  export PYTHONPATH=/tmp/site:/tmp/site3:/tmp/apex:$REPO
  python3 -c "from nemo.core.optim.distributed_adam import MegatronDistributedFusedAdam; print('NeMo MegatronDistributedFusedAdam imports')" > /tmp/rs/nemo_import.log 2>&1
  tail -4 /tmp/rs/nemo_import.log | cut -c1-400; APEX_READY=1
}
if [ "$WHAT" = verify ]; then
  run te_verify_probe 60 python3 validation/te_cuda_graph_probe.py --verify-only
  run mcore_dp2_delayed_verify 150 python3 validation/real_stack_mcore.py --dp 2 --recipe delayed --verify-every 1
  finish
fi
if [ "$WHAT" = forcedsync ]; then
  EV="--dp 2 --recipe tensorwise --steps 4 --eval-between-steps --gather-with-optimizer"
  run mcore016_eval_gwo 200 python3 validation/real_stack_mcore.py $EV
  grep "^INFO" /tmp/rs/mcore016_eval_gwo.log | cut -c1-400
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site19 "$H"/mc19/megatron_core-*.whl
  PYTHONPATH=/tmp/site19:$PYTHONPATH run mcore019_eval_gwo 200 python3 validation/real_stack_mcore.py $EV
  grep "^INFO" /tmp/rs/mcore019_eval_gwo.log | cut -c1-400
  left 430 && run mcore016_dp2_delayed 150 python3 validation/real_stack_mcore.py --dp 2 --recipe delayed
  finish
fi
if [ "$WHAT" = blockwise ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site19 "$H"/mc19/megatron_core-*.whl
  PYTHONPATH=/tmp/site19:$PYTHONPATH run mcore019_dp2_blockwise 200 python3 validation/real_stack_mcore.py --dp 2 --recipe blockwise
  grep -E "Traceback|Error" /tmp/rs/mcore019_dp2_blockwise.log | cut -c1-400 | head -8
  # The plugin's verify mode on real blockwise weights: column-wise bytes and scales vs row-wise
  left 380 && PYTHONPATH=/tmp/site19:$PYTHONPATH run mcore019_dp2_blockwise_verify 120 python3 validation/real_stack_mcore.py --dp 2 --recipe blockwise --steps 3 --verify-every 1
  left 400 && run mcore016_dp2_blockwise 150 python3 validation/real_stack_mcore.py --dp 2 --recipe blockwise
  finish
fi
if [ "$WHAT" = apex1mb ]; then
  apex_ready
  run apex_dp2_delayed_1mb 200 python3 validation/real_stack_apex.py --dp 2 --recipe delayed --bucket-cap-mb 1
  python3 -c "import json,glob; [print(f.split('/')[-1], r['policy'], 'params with bytes in this rank\'s shard:', r.get('params_with_local_shard'), 'buckets:', r.get('buckets')) for f in sorted(glob.glob('/tmp/rs/apex_dp2_delayed_1mb/rank*.json')) for r in json.load(open(f))]"
  finish
fi
if [ "$WHAT" = graphs ]; then
  run te_cuda_graph_probe 120 python3 validation/te_cuda_graph_probe.py
  grep -E "^\[INFO\]|Traceback|Error" /tmp/rs/te_cuda_graph_probe.log | cut -c1-400 | head -40
  run mcore_dp2_delayed 150 python3 validation/real_stack_mcore.py --dp 2 --recipe delayed
  grep "transpose buffer moves" /tmp/rs/mcore_dp2_delayed.log | cut -c1-1500
  finish
fi
if [ "$WHAT" != apex ]; then
  run mcore_dp2_delayed 150 python3 validation/real_stack_mcore.py --dp 2 --recipe delayed
  left 480 && run mcore_dp2_tensorwise 120 python3 validation/real_stack_mcore.py --dp 2 --recipe tensorwise
fi
if [ "$WHAT" != mcore ]; then
  apex_ready
  left 470 && run apex_dp2_delayed 130 python3 validation/real_stack_apex.py --dp 2 --recipe delayed
fi
if [ "$WHAT" != apex ]; then
  left 480 && run mcore_dp1_delayed 100 python3 validation/real_stack_mcore.py --dp 1 --recipe delayed
  left 500 && run mcore_dp1_tensorwise 80 python3 validation/real_stack_mcore.py --dp 1 --recipe tensorwise
fi
[ "$WHAT" != mcore ] && left 470 && run apex_dp2_tensorwise 110 python3 validation/real_stack_apex.py --dp 2 --recipe tensorwise
cp /tmp/te_build.log /tmp/apex_build.log /tmp/rs/ 2>/dev/null
tar czf "$OUT"/real_stack.tar.gz -C /tmp rs
el "done"
