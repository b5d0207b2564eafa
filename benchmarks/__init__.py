"""zeroshard's benchmarks: one runner (``python -m benchmarks NAME [options]``) over one
harness (benchmarks/harness.py); each benchmark is a spec module in benchmarks/specs/.
The other modules here are what the specs share: gpt (the model), training (building
each variant and its step), comm_count, cpu_memory, peers (DeepSpeed), and report (the
tables, plots and RESULTS.md from the JSON in benchmarks/out/)."""
