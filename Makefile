# Two entry points (README quick start): `make demo` and `make test`. Both build the pinned CPU
# environment in .venv first (NeMo 2.3.3 + megatron-core 0.12.3); `make test` also builds
# .venv-mcore016 (megatron-core 0.16.1) and .venv-mcore019 (Python 3.12, megatron-core 0.19.2,
# with Megatron-LM's loop; 0.17.1 and 0.18.2 read from their wheels) and runs the tests on each.
PY ?= python3
VENV ?= .venv
VENV16 ?= .venv-mcore016
VENV19 ?= .venv-mcore019
PY312 ?= $(shell ls "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1 || command -v python3.12)
PIP_FLAGS ?= -q --disable-pip-version-check
DEMO_ARGS ?= --pp 2 --vp 2 --dp 2 --microbatches 4 --steps 3 --policy aligned --telemetry telemetry.jsonl

.PHONY: install install-mcore016 install-mcore019 demo test test-mcore019 smoke smoke-nemo2x

$(VENV)/.installed: requirements/cpu.txt requirements/nodeps.txt requirements/nemo2.txt requirements/constraints.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -c requirements/constraints.txt -r requirements/cpu.txt
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps -r requirements/nodeps.txt
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps --target $(VENV)/nemo2-deps -r requirements/nemo2.txt
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

$(VENV16)/.installed: requirements/mcore016.txt requirements/constraints.txt pyproject.toml
	$(PY) -m venv $(VENV16)
	$(VENV16)/bin/pip install $(PIP_FLAGS) -c requirements/constraints.txt -r requirements/mcore016.txt
	$(VENV16)/bin/pip install $(PIP_FLAGS) --no-deps megatron-core==0.16.1
	$(VENV16)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

$(VENV19)/.installed: requirements/mcore019.txt requirements/constraints.txt pyproject.toml
	$(PY312) -m venv $(VENV19)
	$(VENV19)/bin/pip install $(PIP_FLAGS) -c requirements/constraints.txt -r requirements/mcore019.txt
	$(VENV19)/bin/pip install $(PIP_FLAGS) --no-deps megatron-core==0.19.2
	$(VENV19)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

install: $(VENV)/.installed
install-mcore016: $(VENV16)/.installed
install-mcore019: $(VENV19)/.installed

demo: install
	$(VENV)/bin/python -m lab.demo $(DEMO_ARGS)

# megatron-core 0.17.1 and 0.18.2: their wheels' megatron/core (pure Python, ~2 MB each), read by
# .venv-mcore019's Python ahead of its own 0.19.2 (MCORE_LINE_TESTS). 0.9.0, 0.10.0 and 0.11.0
# (the NeMo Framework containers 24.09 to early 2025): their Python 3.11 wheels' megatron/core,
# read by .venv's Python ahead of its 0.12.3 (MCORE_OLD_LINE_TESTS). 0.7.0 and 0.8.0 (24.05,
# 24.07), whose all-gather is the DistributedOptimizer's chain (the plugin's optimizer hold):
# the same, plus setuptools < 70's pkg_resources, which they import (MCORE_OPTIMIZER_LINE_TESTS).
MCORE_LINES ?= 0.17.1 0.18.2
MCORE_OLD_LINES ?= 0.9.0 0.10.0 0.11.0
MCORE_OPTIMIZER_LINES ?= 0.7.0 0.8.0
MCORE_TREES = .mcore-wheels
OLD_TREES = $(foreach v,$(MCORE_OLD_LINES) $(MCORE_OPTIMIZER_LINES),$(MCORE_TREES)/$(v)/.unpacked)

$(MCORE_TREES)/.installed: $(VENV19)/.installed $(VENV)/.installed
	for v in $(MCORE_LINES); do \
	  $(VENV19)/bin/pip download $(PIP_FLAGS) --no-deps --only-binary=:all: megatron-core==$$v -d $(MCORE_TREES) && \
	  mkdir -p $(MCORE_TREES)/$$v && unzip -q -o $(MCORE_TREES)/megatron_core-$$v-*.whl 'megatron/core/*' -d $(MCORE_TREES)/$$v; \
	done
	touch $@

# One stamp per old version, so a checkout that unpacked some already fetches only the others.
$(MCORE_TREES)/%/.unpacked: | $(VENV)/.installed
	$(VENV)/bin/pip download $(PIP_FLAGS) --no-deps --only-binary=:all: megatron-core==$* -d $(MCORE_TREES)
	mkdir -p $(MCORE_TREES)/$* && unzip -q -o $(MCORE_TREES)/megatron_core-$*-*.whl 'megatron/core/*' -d $(MCORE_TREES)/$*
	if grep -rqs 'from pkg_resources' $(MCORE_TREES)/$*/megatron/core; then \
	  $(VENV)/bin/pip download $(PIP_FLAGS) --no-deps --only-binary=:all: 'setuptools<70' -d $(MCORE_TREES)/setuptools && \
	  unzip -q -o $(MCORE_TREES)/setuptools/setuptools-*.whl 'pkg_resources/*' -d $(MCORE_TREES)/$*; \
	fi
	touch $@

# megatron-bridge 0.6.2's training/callbacks.py (standard library only), which
# tests/test_bridge_callback.py loads by path: Bridge itself does not install or import on a CPU
# machine. The wheel needs Python 3.12; --python-version lets any venv's pip fetch it.
BRIDGE_VERSION ?= 0.6.2
BRIDGE_WHEEL = .bridge-wheel

$(BRIDGE_WHEEL)/.installed: $(VENV)/.installed
	$(VENV)/bin/pip download $(PIP_FLAGS) --no-deps --only-binary=:all: --python-version 3.12 \
	  megatron-bridge==$(BRIDGE_VERSION) -d $(BRIDGE_WHEEL)
	unzip -q -o $(BRIDGE_WHEEL)/megatron_bridge-$(BRIDGE_VERSION)-*.whl \
	  'megatron/bridge/training/callbacks.py' -d $(BRIDGE_WHEEL)
	touch $@

# Transformer Engine's released Python source (the wheels are pure Python, ~0.4-1.2 MB each), read
# with ast by tests/test_te_api_source.py against the backend's per-version calls: TE 1.9 - 1.13
# (1.9.0's wheel is empty: 1.9.0.post1) and one version of each 2.x API generation boundary.
TE_SOURCE_VERSIONS ?= 1.9.0.post1 1.10.0 1.11.0 1.12.0 1.13.0 2.1.0 2.9.0 2.10.0 2.20.2
TE_TREES = .te-wheels

$(TE_TREES)/.installed: | $(VENV)/.installed
	for v in $(TE_SOURCE_VERSIONS); do \
	  $(VENV)/bin/pip download $(PIP_FLAGS) --no-deps --only-binary=:all: transformer_engine==$$v -d $(TE_TREES) && \
	  mkdir -p $(TE_TREES)/$$v && unzip -q -o $(TE_TREES)/transformer_engine-$$v-py3-none-any.whl 'transformer_engine/pytorch/*' -d $(TE_TREES)/$$v || exit 1; \
	done
	touch $@

MCORE019_TESTS = tests/test_schedule.py tests/test_engine_mcore.py tests/test_faults.py \
	tests/test_refusals.py tests/test_api.py tests/test_cpu_compat.py tests/test_gather_with_optimizer.py \
	tests/test_groups.py tests/test_forced_sync.py tests/test_no_hang.py tests/test_entry_points.py tests/test_bridge_callback.py \
	tests/test_megatron_lm_parser_019.py tests/test_recipe_support.py tests/test_recipes_demo.py \
	tests/test_mcore_versions.py tests/test_optimizer_instances.py

# On 0.17.1 and 0.18.2: the schedule tables, the refusal rows, and the two paths that changed
# between them (0.18 post-processes forced all-gathers itself; the optimizer-step all-gather);
# and `check --megatron-core`'s version table against each line's classes.
MCORE_LINE_TESTS = tests/test_schedule.py tests/test_refusals.py tests/test_forced_sync.py \
	tests/test_gather_with_optimizer.py tests/test_recipe_support.py tests/test_mcore_versions.py
# On 0.9.0, 0.10.0 and 0.11.0: the engine on the real schedule and DDP, the fault battery, the
# no-hang agreement, the entry points and the refusals (0.9.0: the pre-0.10 legacy order); the
# check's verdicts against the version's own schedule validation (test_mcore_versions).
MCORE_OLD_LINE_TESTS = $(MCORE_LINE_TESTS) tests/test_engine_mcore.py tests/test_faults.py \
	tests/test_no_hang.py tests/test_entry_points.py tests/test_api.py \
	tests/test_optimizer_instances.py
# On 0.7.0 and 0.8.0: the schedule model against their own schedule, the version's own rules
# and refusals (the refusal rows, the recipes, the attach-time checks), and the engine through
# the optimizer's all-gather chain (one shared demo run per policy: aligned, lazy, off; 0.7.0 at
# PP 4, which it needs for interleaving); the fault battery and the no-hang agreement on that
# chain (0.7.0: PP 4 only; no DDP bucket groups there), ~20 s more a version. test_entry_points
# skips itself (no DDP start_param_sync; test_mcore_optimizer_gather has the all-or-nothing
# attach with optimizer=); --dist-opt-instances refused with the version (test_optimizer_instances).
MCORE_OPTIMIZER_LINE_TESTS = tests/test_schedule.py tests/test_mcore_versions.py \
	tests/test_refusals.py tests/test_recipe_support.py tests/test_api.py \
	tests/test_mcore_optimizer_gather.py tests/test_faults.py tests/test_no_hang.py \
	tests/test_entry_points.py tests/test_optimizer_instances.py

test: install install-mcore016 install-mcore019 $(MCORE_TREES)/.installed $(OLD_TREES) $(BRIDGE_WHEEL)/.installed $(TE_TREES)/.installed
	$(VENV)/bin/python -m pytest -q
	$(VENV16)/bin/python -m pytest -q -m "not nemo" tests/test_schedule.py tests/test_engine_mcore.py \
		tests/test_refusals.py tests/test_api.py tests/test_pipeline_step_time_mps.py \
		tests/test_groups.py tests/test_forced_sync.py tests/test_gather_with_optimizer.py \
		tests/test_no_hang.py tests/test_entry_points.py tests/test_recipe_support.py \
		tests/test_recipes_demo.py tests/test_mcore_versions.py tests/test_optimizer_instances.py
	$(VENV19)/bin/python -m pytest -q -m "not nemo" $(MCORE019_TESTS)
	for v in $(MCORE_LINES); do \
	  PYTHONPATH=$(CURDIR)/$(MCORE_TREES)/$$v $(VENV19)/bin/python -m pytest -q -m "not nemo" \
	    $(MCORE_LINE_TESTS) || exit 1; \
	done
	for v in $(MCORE_OLD_LINES); do \
	  PYTHONPATH=$(CURDIR)/$(MCORE_TREES)/$$v $(VENV)/bin/python -m pytest -q -m "not nemo" \
	    $(MCORE_OLD_LINE_TESTS) || exit 1; \
	done
	for v in $(MCORE_OPTIMIZER_LINES); do \
	  PYTHONPATH=$(CURDIR)/$(MCORE_TREES)/$$v $(VENV)/bin/python -m pytest -q -m "not nemo" \
	    $(MCORE_OPTIMIZER_LINE_TESTS) || exit 1; \
	done
	$(VENV19)/bin/python -m pytest -q $(MEGATRON_LM_TESTS) tests/test_doc_snippets.py \
		-k "not test_block_runs_as_documented or megatron_lm_snippet or bridge_snippet"

# Megatron-LM's own loop (megatron/training in the 0.19.2 wheel) and the chunk-level attachment:
# ~1.5 minutes on 2 cores (4 demo jobs of 4 processes, and the 0.19 rebinding-loop demo).
MEGATRON_LM_TESTS = tests/test_megatron_lm_loop.py tests/test_megatron_lm_mode.py

test-mcore019: install-mcore019
	$(VENV19)/bin/python -m pytest -q $(MEGATRON_LM_TESTS)

smoke: install
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash validation/smoke_nemo.sh

# NeMo 2.0-2.2 with their containers' megatron-core, on the CPU (by hand, not in `make test`:
# ~3 minutes a version; benchmarks/results/nemo_2x_cpu.md). Fetches into .nemo2x/.
smoke-nemo2x: install
	bash validation/smoke_nemo_2x.sh 2.0.0 0.9.0
	bash validation/smoke_nemo_2x.sh 2.1.0 0.10.0
	bash validation/smoke_nemo_2x.sh 2.2.1 0.11.0
