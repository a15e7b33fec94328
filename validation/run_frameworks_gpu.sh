#!/bin/bash
# Issue 39 item 2, one device call: the frameworks themselves on ONE GPU with Transformer Engine
# 2.20.2 Float8Tensor weights, the pipeline ranks sharing the GPU through CUDA MPS and a
# host-staging gloo process group (lab/host_staging.py):
#   (a) NeMo's stock megatron_gpt_pretraining.py flow (examples/stock_megatron_gpt_pretraining.py,
#       nemo_toolkit 2.3.3 MegatronGPTModel, megatron-core 0.12.3, optim mcore_distributed_optim,
#       Apex built there because NLPDDPStrategy refuses to start without it), the plugin through
#       its Lightning entry point (the package installed with pip) and Hydra overrides only;
#       PP=2 DP=2 VP=2, 4 ranks at 25% of the SMs each;
#   (b) NeMo 2: nl.Trainer + MegatronStrategy fit with FP8TransposeAlignNeMo2
#       (validation/frameworks_gpu.py nemo2), PP=2 VP=2, 2 ranks at 50%;
#   (c) Megatron-Bridge 0.6.2: an import probe of its pretrain path (megatron-core 0.19.2).
# Each of (a) and (b): aligned, off and a one-rank fault side by side, then
# `python -m nemo_fp8_align report` and frameworks_gpu.py judge (PASS/FAIL lines).
#
# Seen on one H100 (2026-12-07, benchmarks/results/frameworks_gpu.md): `b a c` in 248 s; (b) passed but for
# `report` on step 0 (nothing to build there); (a) stopped in NeMo's trainer build (megatron-core 0.12.3's
# checkpoint strategies import zarr: carry zarr 2.x + numcodecs next); (c) needs datasets, megatron-energon
# and nvidia-modelopt beyond the image.
# Usage (repo root, .h200 carried): bash validation/run_frameworks_gpu.sh [WHAT...]
#   WHAT: probe (imports only), b, a, c (default: probe b a c); logs and results under $OUT.
# Carry: .h200 (about 54 MiB), made on the CPU machine (.git/info/exclude has /.h200/):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 ...
#   tecore/  transformer-engine-cu13 2.20.2 minus libtransformer_engine.so (zip -d), whose sm_90-only
#            copy (validation/strip_fatbin.py --keep-sm 90) is libte_sm90.so.gz (+ .sha256);
#   transformer_engine-2.20.2-py3-none-any.whl, transformer_engine_torch-2.20.2.tar.gz (source,
#     built here; or te_torch_ext.so.gz, a build an earlier call left in $OUT);
#   spare/typing_extensions (used only where the image's is too old for pydantic);
#   apex-src.tar.gz + apex_setup_min.py (../shared/gpu: built here, 2-3 minutes; its extensions
#     are over the 16 MiB a file that $OUT returns, so every call that runs (a) builds them);
#   mcore/   megatron_core-0.12.3.tar.gz (no Python 3.12 wheel exists: built here) + pybind11 wheel;
#   pyd.tar.xz, nemo.tar.xz, nemo1.tar.xz, bridge.tar.xz: Python 3.12 wheels installed on the CPU
#     machine with `pip install --no-deps --only-binary=:all: --python-version 3.12 --target DIR`
#     (bridge: unzipped) and packed with `tar cf - DIR | xz -6` (xz takes the Python sources to
#     about 40% of the wheels' size; the four are 19 MB against 47 MB of wheels):
#     pyd/    pydantic, pydantic-core, annotated-types, typing-inspection (TE's recipes);
#     nemo/   nemo_toolkit 2.3.3, lightning 2.4.0 + lightning-fabric 2.4.0 (NeMo 2.3.3 does not
#             import with the image's lightning 2.6.6), hydra-core 1.3.2, omegaconf 2.3.0,
#             antlr4 4.9.3, wget 3.2, fiddle 0.3.1, libcst, graphviz, nvidia-resiliency-ext 0.4.1,
#             defusedxml (what nemo.lightning imports beyond the image, whose package list is
#             ../.library/device/KINDS.md);
#     nemo1/  transformers 4.51.3, tokenizers 0.21.4, huggingface-hub 0.36.2 (the image's
#             transformers 5.17.0 has no BasicTokenizer, which nemo.collections.nlp imports, and
#             NeMo 2's MegatronParallel.forward imports nemo.collections.nlp), opencc, pangu,
#             rouge-score, nltk, webdataset, braceexpand, ijson. jieba (a 37 MB package, 17 MB
#             even with xz) is NOT carried: an import-only stand-in takes its place
#             (frameworks_gpu.py standins: every call of it raises);
#     bridge/ megatron-bridge 0.6.2, megatron-core 0.19.2, nvidia-resiliency-ext 0.7.0.
set -o pipefail
export PYTHONUNBUFFERED=1 NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 CUBLAS_WORKSPACE_CONFIG=:4096:8
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=2
OUT=${OUT:-/tmp/out}; W=/tmp/fw; mkdir -p "$OUT" $W
REPO=$PWD; H=$REPO/.h200; T0=$(date +%s); WHAT=${*:-probe b a c}
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
has() { case " $WHAT " in *" $1 "*) return 0;; esac; return 1; }
pack() { tar czf "$OUT"/frameworks_gpu.tar.gz -C /tmp fw 2>/dev/null; }
PIP="python3 -m pip install -q --no-index --no-deps --no-compile"
$PIP --target /tmp/site "$H"/tecore/*.whl "$H"/transformer_engine-2.20.2-py3-none-any.whl || exit 1
gunzip -c "$H"/libte_sm90.so.gz > /tmp/site/transformer_engine/wheel_lib/libtransformer_engine.so
echo "libtransformer_engine.so sha256 want $(cat "$H"/libte_sm90.sha256) got $(sha256sum /tmp/site/transformer_engine/wheel_lib/libtransformer_engine.so | cut -c1-64)"
for x in pyd nemo nemo1 bridge; do tar xJf "$H"/$x.tar.xz -C /tmp || exit 1; done  # -> /tmp/<x>/
mv /tmp/pyd /tmp/site3
PYTHONPATH=/tmp/site3 python3 -c "import pydantic" 2>/dev/null || $PIP --target /tmp/site3 "$H"/spare/typing_extensions-*.whl
EXT=transformer_engine_torch.cpython-312-x86_64-linux-gnu.so
NEED_APEX=0; has a && NEED_APEX=1
if [ -f "$H"/te_torch_ext.so.gz ]; then
  gunzip -c "$H"/te_torch_ext.so.gz > /tmp/site/transformer_engine/wheel_lib/$EXT; el "TE extension from the bundle"; TE_PID=
else
  (mkdir -p /tmp/tebuild && tar xzf "$H"/transformer_engine_torch-2.20.2.tar.gz -C /tmp/tebuild &&
   cd /tmp/tebuild/transformer_engine_torch-2.20.2 &&
   PYTHONPATH=/tmp/site MAX_JOBS=$([ $NEED_APEX = 1 ] && echo 10 || echo 16) NVTE_CUDA_ARCHS=90 \
   NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch \
     python3 -m pip install --no-index --no-deps --no-build-isolation --target /tmp/site2 . &&
   cp /tmp/site2/transformer_engine/wheel_lib/$EXT /tmp/site/transformer_engine/wheel_lib/ &&
   gzip -c /tmp/site/transformer_engine/wheel_lib/$EXT > "$OUT"/te_torch_ext.so.gz &&
   echo TE_BUILD_OK) > $W/te_build.log 2>&1 &
  TE_PID=$!
fi
APEX_PID=
if [ $NEED_APEX = 1 ]; then
  if [ -f "$H"/apex_ext.tar.gz ]; then
    mkdir -p /tmp/apex && tar xzf "$H"/apex-src.tar.gz -C /tmp/apex && tar xzf "$H"/apex_ext.tar.gz -C /tmp/apex
    el "Apex extensions from the bundle"
  else
    (mkdir -p /tmp/apex && tar xzf "$H"/apex-src.tar.gz -C /tmp/apex && cp "$H"/apex_setup_min.py /tmp/apex/ &&
     cd /tmp/apex && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$([ -n "$TE_PID" ] && echo 6 || echo 12) python3 apex_setup_min.py build_ext --inplace &&
     tar czf "$OUT"/apex_ext.tar.gz $(find . -name "*.so") && echo APEX_BUILD_OK) > $W/apex_build.log 2>&1 &
    APEX_PID=$!
  fi
fi
# megatron-core 0.12.3 has no Python 3.12 wheel: build its sdist (one small C++ helper)
$PIP --target /tmp/pyb "$H"/mcore/pybind11-*.whl
(PYTHONPATH=/tmp/pyb PATH=/tmp/pyb/bin:$PATH python3 -m pip install -q --no-index --no-deps --no-build-isolation \
  --target /tmp/mc12 "$H"/mcore/megatron_core-0.12.3.tar.gz > $W/mcore_build.log 2>&1; echo "mcore 0.12.3 build rc=$?" >> $W/mcore_build.log)
tail -1 $W/mcore_build.log
python3 validation/frameworks_gpu.py standins /tmp/nemo1 jieba > /dev/null
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug . > $W/plugin_install.log 2>&1
el "installed (plugin: $(ls /tmp/plug | grep -c dist-info) dist-info, entry points: $(cat /tmp/plug/nemo_fp8_align-*.dist-info/entry_points.txt 2>/dev/null | grep -c callbacks_factory))"
python3 -m pip list 2>/dev/null > $W/image_pip_list.txt
[ -n "$TE_PID" ] && { wait $TE_PID; el "TE extension build: $(tail -1 $W/te_build.log)"; }
BASEPP=/tmp/plug:/tmp/site:/tmp/site3:$REPO:$REPO/tests
PP12=/tmp/nemo:/tmp/mc12:/tmp/nemo1:$BASEPP
export PYTHONPATH=$PP12
python3 -c "import torch, transformer_engine as t, transformer_engine.pytorch, megatron.core as m, lightning, transformers, huggingface_hub as h, numpy; print('torch', torch.__version__, 'TE', t.__version__, 'megatron-core', m.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__, 'hub', h.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name(0))" 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if has probe; then
  timeout 120 python3 validation/frameworks_gpu.py probe nemo.lightning \
    nemo.collections.nlp.models.language_modeling.megatron_gpt_model \
    nemo.collections.nlp.parts.megatron_trainer_builder nemo.utils.exp_manager > $W/probe_nemo.log 2>&1
  grep PROBE $W/probe_nemo.log | cut -c1-700
fi
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && el "MPS daemon started"
SP="python3 validation/frameworks_gpu.py spawn"
if has b; then
  el "start (b) NeMo 2: aligned, off, fault"
  $SP nemo2_aligned $W/b/aligned 2 150 -- python3 validation/frameworks_gpu.py nemo2 $W/b/aligned --policy aligned --comm-overlap & B1=$!
  $SP nemo2_off $W/b/off 2 150 -- python3 validation/frameworks_gpu.py nemo2 $W/b/off --policy off --comm-overlap & B2=$!
  $SP nemo2_fault $W/b/fault 2 150 -- python3 validation/frameworks_gpu.py nemo2 $W/b/fault --policy aligned --fault-rank 1 --fault-step 1 & B3=$!
  wait $B1 $B2 $B3; el "(b) done"
  python3 validation/frameworks_gpu.py judge nemo2 $W/b 2 2>&1 | tee $W/b/judge.txt | cut -c1-900
  grep -h -m3 -E "Error|error:" $W/b/aligned/rank*.log | cut -c1-400; pack
fi
[ -n "$APEX_PID" ] && { wait $APEX_PID; el "Apex build: $(tail -1 $W/apex_build.log)"; }
if has a; then
  export PYTHONPATH=/tmp/apex:$PP12
  el "start (a) NeMo stock flow: aligned, off, fault"
  A="examples/stock_megatron_gpt_pretraining.py --config-name megatron_gpt_cpu trainer.accelerator=gpu trainer.devices=1
     trainer.num_nodes=4 trainer.max_steps=4 trainer.logger=true exp_manager.name=null model.transformer_engine=true
     model.fp8=true model.fp8_params=true model.fp8_hybrid=true model.use_cpu_initialization=false
     model.attention_backend=unfused model.tokenizer.library=null"
  for r in aligned off fault; do
    PLUG=()  # off: the plugin's entry point adds its callback, inert without the block
    [ $r != off ] && PLUG=(+model.fp8_transpose_align.policy=aligned
      "+model.fp8_transpose_align.telemetry_path=\"$W/a/$r/telemetry.rank{rank}.jsonl\"")
    [ $r = fault ] && export FRAMEWORKS_GPU_FAULT=capture_on_one_rank || unset FRAMEWORKS_GPU_FAULT
    $SP nemo1_$r $W/a/$r 4 150 -- python3 validation/frameworks_gpu.py nemo1 $A +trainer.default_root_dir=$W/a/$r/exp \
      hydra.run.dir=$W/a/$r/hydra "${PLUG[@]}" & APIDS="$APIDS $!"
  done
  unset FRAMEWORKS_GPU_FAULT; wait $APIDS; el "(a) done"
  python3 validation/frameworks_gpu.py judge nemo1 $W/a 4 2>&1 | tee $W/a/judge.txt | cut -c1-900
  grep -h -m3 -E "Error|error:" $W/a/aligned/rank*.log | cut -c1-400; pack
fi
if has c; then
  PYTHONPATH=/tmp/bridge:/tmp/nemo:$BASEPP timeout 60 python3 validation/frameworks_gpu.py probe megatron.bridge \
    megatron.bridge.training.pretrain megatron.bridge.training.gpt_step > $W/probe_bridge.log 2>&1
  grep PROBE $W/probe_bridge.log | cut -c1-700
fi
echo quit | nvidia-cuda-mps-control
pack; el done  # $OUT: frameworks_gpu.tar.gz (all logs), te_torch_ext.so.gz, apex_ext.tar.gz
