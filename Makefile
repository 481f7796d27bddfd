# The README's two commands are `make demo` and `make test`; both set everything up first.
PY := .venv/bin/python

.PHONY: setup build demo test bench clean

setup:
	@bash scripts/setup.sh

build:
	@$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .

# As root: three emulated hosts (tools/demo_fleet.py); otherwise it says why and runs the one-host demo.
demo: setup
	@$(PY) -m tools.demo_fleet

test: setup
	@bash scripts/test.sh

bench: setup
	@$(PY) -m tools.bench

clean:
	rm -rf build .venv *.egg-info
