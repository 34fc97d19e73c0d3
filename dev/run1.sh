set -x
export PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 150 python -m pytest -q -x -m gpu tests/test_sampler.py 2>&1 | tail -5 | tee $OUT/sampler.log
timeout 120 python bench.py --workload w1 --engines nanoserve --json $OUT/w1.json 2>&1 | tail -15 | tee $OUT/bench.log
timeout 200 python tools/profile_steps.py --kernels 2>&1 | tee $OUT/profile.log | tail -150
timeout 100 python tools/profile_steps.py --prefill --kernels 2>&1 | tee $OUT/prefill.log | tail -60
