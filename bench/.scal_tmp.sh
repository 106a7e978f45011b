export LD_LIBRARY_PATH=$PWD/build/lib/gpu-host
d=$(mktemp -d); ./build/bin/normd --device 0 --socket $d/s --state-dir $d --config /dev/null --log-level warn 2>$d/log & p=$!
sleep 2
load="--socket $d/s --threads 2 --inflight 4 --verify 0.01 --ops ln_fwd,ln_bwd,rms_fwd,rms_bwd,wgrad --rows 1-512 --cols 1-8192"
./build/bin/normstress $load --procs 4 --jobs 10000 >/dev/null 2>&1
for reuse in 0 100; do
echo "kit_reuse=$reuse"; ./build/bin/normstress $load --procs 16 --jobs 100000 --kit-reuse $reuse --seed 3 | grep -E "^jobs|^latency|^result"
done
echo "1 proc, kit_reuse=0"; ./build/bin/normstress $load --procs 1 --jobs 20000 --kit-reuse 0 --seed 4 | grep -E "^jobs|^latency"
kill $p; wait $p
