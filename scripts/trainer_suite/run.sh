#!/usr/bin/env bash
# transformers' tests/trainer suite in three modes (co2_swap.py): plain, identity, defaults; then
# compare.py lists the tests that pass with the plain Trainer and fail with CO2Trainer.
#
#   git clone --depth 1 --branch v5.24.0 https://github.com/huggingface/transformers /tmp/transformers
#   scripts/trainer_suite/run.sh /tmp/transformers/tests/trainer out_dir [test_file.py ...]
#
# Tests run offline (HF_HUB_OFFLINE=1): those needing a Hub model fail in every mode alike. The
# suite needs `parameterized` (and `optuna` for the search tests); each test is bounded by 300 s.
set -u
TESTS="${1:?usage: run.sh TESTS_DIR OUT_DIR [files...]}"
OUT="${2:?usage: run.sh TESTS_DIR OUT_DIR [files...]}"
shift 2
HERE="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$OUT"
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=($(cd "$TESTS" && ls test_*.py))
PATHS=()
for f in "${FILES[@]}"; do PATHS+=("$TESTS/$f"); done
# the tests import their helpers as tests.trainer.*: the checkout's root goes on the path
# (and this folder, for the plugin co2_swap.py that swaps the classes)
export PYTHONPATH="$HERE:$(cd "$TESTS/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_DISABLED=true TOKENIZERS_PARALLELISM=false
unset WORLD_SIZE RANK LOCAL_RANK MASTER_ADDR MASTER_PORT
for mode in plain identity defaults; do
    start=$(date +%s)
    CO2_MODE=$mode python -m pytest "${PATHS[@]}" -p co2_swap -c "$HERE/pytest.ini" -p no:cacheprovider \
        --timeout 300 -q --junitxml "$OUT/$mode.xml" -o junit_family=xunit2 > "$OUT/$mode.log" 2>&1
    echo "$mode: $(tail -1 "$OUT/$mode.log") ($(( $(date +%s) - start )) s)"
done
python "$HERE/compare.py" --results "$OUT"
