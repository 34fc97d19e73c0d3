set -x
export PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
timeout 120 python dev/sampler_bench.py 2>&1 | tee $OUT/sampler_bench.log
timeout 150 python -m pytest -q -x -m gpu tests/test_sampler.py 2>&1 | tail -3 | tee $OUT/sampler.log
TORCH_LOGS=recompiles timeout 150 python dev/diag.py 2>&1 | grep -v Warning | tee $OUT/diag.log | tail -40
timeout 120 python tools/profile_steps.py --json $OUT/prof.json 2>&1 | tail -8
