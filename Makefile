# Thin wrapper over CMake. `make run` and `make test` install what they need.
BUILD_DIR ?= build
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc)
PROMPT ?= def fibonacci(n):

.PHONY: deps configure build run test test-gpu clean

deps:
	@./tools/install_deps.sh

configure: deps
	@cmake -S . -B $(BUILD_DIR) -G Ninja $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

# Generates a continuation of a sample prompt with the shipped tiny model.
run: build
	@$(BUILD_DIR)/bin/nucleus generate --model models/tiny-dsv3 --prompt "$(PROMPT)" --max-tokens 48

# Every CPU test (ctest label cpu).
test: build
	@cd $(BUILD_DIR) && ctest -L cpu --output-on-failure -j $(JOBS)

# GPU tests (label gpu): on a machine with an H200.
test-gpu: build
	@cd $(BUILD_DIR) && ctest -L gpu --output-on-failure

clean:
	rm -rf $(BUILD_DIR)
