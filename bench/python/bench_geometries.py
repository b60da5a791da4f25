"""The synthetic model geometries the Python benchmarks run
(bench_job.py, bench_local_statistics.py): name -> (layers, attention
heads, KV heads, head_dim)."""

GEOMETRIES = {
    "tiny": (4, 8, 2, 64),
    "llama3-8b": (32, 32, 8, 128),
    "llama3-70b": (80, 64, 8, 128),
    "llama3-405b": (126, 128, 8, 128),
}
