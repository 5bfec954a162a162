"""redraft.clients: the client-side commands that ship with the package, `redraft bench` (bench.py, on the
load-generation core loadgen.py that benchmarks/bench_serving.py shares, and sse.py) and
`redraft plan` (memory_plan.py). The benchmark scripts behind the documented figures live in benchmarks/."""
