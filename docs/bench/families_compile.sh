# The tiny family recipes under zero3.json on one GPU, each with its train.compile as written ("auto") and with
# false: what the compile costs (timestamps on every line: the compile sits between the "compile:" line and step 10)
# and what it buys (tokens/s at the later steps). Run from the checkout's root on the GPU machine; logs in $OUT.
#   RUNS="NAME:RECIPE:STEPS:COMPILE ..." (COMPILE auto|false), default below
. docs/bench/gpu_env.sh deepspeed,pytest,torchao,trl
run() {  # run NAME RECIPE STEPS COMPILE: the recipe copied with train.compile set
  python3 -c "import sys, yaml; r = yaml.safe_load(open(sys.argv[1])); r.setdefault('train', {})['compile'] = \
{'auto': 'auto', 'false': False}[sys.argv[2]]; yaml.safe_dump(r, open(sys.argv[3], 'w'))" "$2" "$4" "/tmp/$1.yaml"
  (date +%s.%N | cut -c1-14; timeout 170 deepspeed --master_port $((29640 + RANDOM % 50)) --num_gpus 1 bin/pretrain.py --deepspeed_config ds_configs/zero3.json --config /tmp/$1.yaml --max_steps $3 --run_dir /tmp/t_$1 2>&1 | grep --line-buffered -v "launch.py:145" | while IFS= read -r l; do echo "$(date +%s.%N | cut -c1-14) $l"; done; echo "rc=${PIPESTATUS[0]}"; date +%s.%N | cut -c1-14) > $OUT/$1.txt 2>&1
  gpu_settle pretrain
}
for r in ${RUNS:-tiny_deepseek_v2_eager:tiny_deepseek_v2:20:false tiny_qwen3_5_auto:tiny_qwen3_5:40:auto \
    tiny_qwen3_5_eager:tiny_qwen3_5:40:false}; do
  IFS=: read -r name recipe steps how <<< "$r"
  run "$name" "engine/recipes/$recipe.yaml" "$steps" "$how"
done
grep -h -E "compile:|step [0-9]+ |rc=" $OUT/*.txt | cut -c1-260
