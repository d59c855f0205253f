# Entry point for building, testing and running the server. `make help` lists the targets.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PIP_INSTALL := $(PIP) install --quiet --disable-pip-version-check -c constraints.txt

INSTALL_STAMP := $(VENV)/.installed
PROTO_STAMP := $(VENV)/.protos
PB_TARGETS := text_generation_common/pb/generate_pb2.py router/pb/generation_pb2.py
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install gen-protos protos lint typecheck test-tools test run demo-model clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

$(INSTALL_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[dev]'
	$(PIP_INSTALL) --no-deps text-generation  # its huggingface-hub<1.0 pin is wrong for us (constraints.txt)
	touch $@

install: $(INSTALL_STAMP) gen-protos ## create .venv and install everything (torch pinned to the CPU build)

# Generated code lives in the packages' git-ignored pb/ folders; imports are rewritten by the
# proto_path mapping so that the modules import each other as package members.
text_generation_common/pb/generate_pb2.py: proto/generate.proto $(INSTALL_STAMP)
	$(PY) -m grpc_tools.protoc -Itext_generation_common/pb=proto \
		--python_out=. --pyi_out=. --grpc_python_out=. proto/generate.proto

router/pb/generation_pb2.py: proto/generation.proto $(INSTALL_STAMP)
	$(PY) -m grpc_tools.protoc -Irouter/pb=proto \
		--python_out=. --pyi_out=. --grpc_python_out=. proto/generation.proto

gen-protos: $(PB_TARGETS) ## generate the Python gRPC code from proto/
protos: gen-protos ## alias of gen-protos

lint: install ## ruff check + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install ## mypy on the typed boundaries
	$(VENV)/bin/mypy

test-tools: install ## install the system tools some tests need where missing (prometheus, kubectl)
	$(PY) -m tests.tools install

test: install test-tools ## run the test suite (installs first if needed)
	$(PY) -m pytest $(PYTEST_ARGS)

DEMO_MODEL := .cache/demo-model

$(DEMO_MODEL)/config.json: $(INSTALL_STAMP) text_generation_server/testing/tiny_models.py
	$(PY) -m text_generation_server.testing.tiny_models --arch llama --out $(DEMO_MODEL)

demo-model: $(DEMO_MODEL)/config.json ## build the embedded demo model (tiny random Llama) offline

run: install demo-model ## start the server on the embedded demo model (gRPC :8033, HTTP :3000)
	@echo "Starting the server on the demo model (a tiny random-weight Llama: its text is gibberish)."
	@echo "From another shell:"
	@echo "  $(PY) -m router.client generate 'def hello(world):' --max-new-tokens 20"
	@echo "  $(PY) -m router.client generate 'import os' --stream --sample --seed 7"
	@echo "  curl -i localhost:3000/health"
	@echo "  curl localhost:3000/generate -H 'Content-Type: application/json' -d '{\"inputs\": \"import os\", \"parameters\": {\"max_new_tokens\": 20}}'"
	@echo "  curl localhost:3000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"max_tokens\": 20}'"
	@echo "  $(PY) -c 'from text_generation import Client; print(Client(\"http://localhost:3000\").generate(\"import os\", max_new_tokens=20).generated_text)'"
	@echo "  $(PY) -c 'import openai; c = openai.OpenAI(base_url=\"http://localhost:3000/v1\", api_key=\"-\"); print(c.completions.create(model=c.models.list().data[0].id, prompt=\"import os\", max_tokens=20).choices[0].text)'"
	@echo "  API docs: http://localhost:3000/docs"
	$(VENV)/bin/text-generation-launcher --model-name $(DEMO_MODEL) --deployment-framework tgis_native \
		--max-sequence-length 512 --max-new-tokens 256

integration-tests: install test-tools ## run only the integration tests (the real launcher on tiny models)
	$(PY) -m pytest integration_tests $(PYTEST_ARGS)

FUZZ_SECONDS ?= 600

.PHONY: fuzz-soak
fuzz-soak: install ## hostile-client soak: random and garbage requests for FUZZ_SECONDS (default 600)
	$(PY) -m integration_tests.fuzz --seconds $(FUZZ_SECONDS)

# Container image (Dockerfile.ubi). CONTAINER_TOOL: docker or podman, whichever is on PATH.
CONTAINER_TOOL ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null)
IMAGE ?= text-gen-server
IMAGE_TAG ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo dev)
BUILD_TARGET ?= release
BUILD_ARGS ?=

build: ## build the image from Dockerfile.ubi (BUILD_TARGET=cpu-tests runs the tests in it)
	@if [ -z "$(CONTAINER_TOOL)" ]; then \
		echo "make build: neither docker nor podman found on PATH (or set CONTAINER_TOOL)" >&2; exit 1; fi
	$(CONTAINER_TOOL) build -f Dockerfile.ubi --target $(BUILD_TARGET) -t $(IMAGE):$(IMAGE_TAG) \
		--build-arg GIT_COMMIT=$(shell git rev-parse HEAD 2>/dev/null || echo unknown) $(BUILD_ARGS) .

.PHONY: integration-tests build

BENCH_ARGS ?=

.PHONY: bench
bench: install ## benchmark suite on the reference model into benchmarks/results/ (BENCH_ARGS="--concurrency sweep")
	$(PY) -m benchmarks $(BENCH_ARGS)

clean: ## remove the virtualenv, generated code and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .cache *.egg-info
	find router/pb text_generation_common/pb -type f ! -name __init__.py -delete
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
