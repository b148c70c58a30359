# The two commands of the quick start are `make demo` and `make test`.
# Everything they need is installed by the targets below (idempotent).
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export IBCKPT_CACHE ?= $(HOME)/.cache/ibckpt

.PHONY: setup system venv native kube kernel helm images demo test lint clean

setup: system venv native kube kernel helm images

system:
	bash tests/testbed/install-system.sh

venv: $(BIN)/.installed
$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

native:
	$(MAKE) -C native

kube:
	bash tests/testbed/build-kube.sh

kernel:
	bash tests/testbed/fetch-kernel.sh

helm:
	bash tests/testbed/fetch-helm.sh

# Node images (pause, test apps, the product from ./Dockerfile), built with buildah.
images: venv kube
	cd tests && ../$(BIN)/python -m testbed.images build

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

demo: setup
	cd tests && ../$(BIN)/python -m testbed.demo

# The node images are left to the session: it builds them in the background on the core its guest
# tests leave free (tests/conftest.py), where the cluster's tests find them.
test: system venv native kube kernel helm lint
	$(BIN)/pytest

clean:
	rm -rf $(VENV) native/build
