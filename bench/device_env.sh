# Source this on the lent GPU machine (no network), from the repository's root:
#   . bench/device_env.sh
# It installs the wheels carried in .whl/ (msgspec, click, tqdm, fa3-fwd: the machine has torch,
# numpy, networkx, transformers, pytest and hypothesis but not these) into /tmp/site and makes
# this checkout importable as capture_plan without an install (the package maps capture_plan to
# the repository's root: pyproject's package-dir), so `python -m pytest` and `python -m bench.X`
# run from here. Fetch the wheels here first (docs/development.md, "Running the benchmarks").
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/capture_plan
export PYTHONPATH=/tmp/site:/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python3 -c 'import capture_plan, msgspec, torch; print("device_env:", torch.__version__, torch.cuda.get_device_name(0))'
