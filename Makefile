# The course's two commands:
#   make lab    create .venv with the tested versions, install attnlab, open JupyterLab on lessons/
#               (Notebook 7 is installed too: .venv/bin/jupyter notebook lessons/)
#   make test   create .venv if missing, run the whole test suite (CI runs exactly this)
#   make test-fast  the daily tier: tests/ without the notebooks (nbval), the browser, the site
#               and the tests marked slow (by their own decorator, or named in SLOW in
#               tests/conftest.py: the one list of what the tier leaves out), 5 examples per
#               property test
# and the course as a website:
#   make site   build it from the stored outputs into build/site/html (warnings are errors)
#
# The tested versions are pinned in one place, attnlab/constraints.txt.
# TORCH_INDEX picks where torch comes from: empty means the default index
# (on PyPI, Linux: a CUDA build); for a CPU-only build on a laptop use
#   make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
CONSTRAINTS := attnlab/constraints.txt
TORCH_INDEX ?=
PYTEST_ARGS ?=

.PHONY: lab test test-fast env docs-env nbgrader-env site clean-env exercises

# LAB_ARGS go to `attnlab lab`: make lab LAB_ARGS="--no-browser --port 8890"
lab: env
	$(BIN)/attnlab lab $(LAB_ARGS)

# --durations: the log ends with the 30 slowest tests, where CI's time goes
test: env docs-env nbgrader-env
	$(BIN)/python -m pytest --durations=30 $(PYTEST_ARGS)

# addopts is emptied because it turns on nbval, which this tier leaves out
test-fast: env
	ATTNLAB_HYPOTHESIS_EXAMPLES=5 $(BIN)/python -m pytest tests -o addopts=-ra -p no:nbval -m "not slow and not browser" \
		--ignore=tests/test_site.py $(PYTEST_ARGS)

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) attnlab/lab_settings/attnlab.json
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -c $(CONSTRAINTS) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[lab,test]'
	$(BIN)/attnlab lab --install-settings
	$(BIN)/attnlab doctor
	touch $@

# the docs extra (Sphinx, myst-nb, the theme, MathJax), added to .venv when first needed;
# tests/test_site.py builds the site too, so make test installs it as well
docs-env: $(VENV)/.docs-installed

$(VENV)/.docs-installed: $(VENV)/.installed pyproject.toml $(CONSTRAINTS)
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[docs]'
	touch $@

# the nbgrader extra (tests/test_grading_nbgrader.py's round trip), added to .venv for make test
nbgrader-env: $(VENV)/.nbgrader-installed

# the tests use nbgrader's commands only: its Lab menu, Validate button, Create Assignment panel and server
# extensions (which warn of a missing nbgrader_config.py) are switched off, so the learner's Lab after `make test`
# is the same as after `make lab` (an instructor who wants them: jupyter labextension enable @jupyter/nbgrader)
NBGRADER_SERVER_EXTENSIONS := $(addprefix nbgrader.server_extensions.,formgrader validate_assignment assignment_list course_list)

$(VENV)/.nbgrader-installed: $(VENV)/.installed pyproject.toml $(CONSTRAINTS)
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[nbgrader]'
	$(BIN)/jupyter server extension disable --sys-prefix $(NBGRADER_SERVER_EXTENSIONS) >/dev/null 2>&1
	$(BIN)/jupyter labextension disable --level=sys_prefix @jupyter/nbgrader >/dev/null 2>&1
	touch $@

site: docs-env
	$(BIN)/python site/build.py --strict

exercises: env
	$(BIN)/attnlab generate

clean-env:
	rm -rf $(VENV)
