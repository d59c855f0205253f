"""The benchmark harness: load generator, baselines and reports (`python -m benchmarks --help`).

Modules, each owning one thing:
  reference_model  the reference Llama (hidden 512, 8 layers), built offline and deterministically
  workload         prompts of exact token lengths: fixed, mixed-length, shared-prefix
  clients          one request over our gRPC API or an OpenAI-compatible HTTP endpoint
  loadgen          closed-loop concurrency and Poisson-rate drivers with a progress bar
  stats            per-point metrics (vLLM `bench serve` field names) and server-side breakdowns
  server           servers started and stopped by pid: our launcher, the vLLM-CPU peer
  baselines        engine-only loop and transformers `generate`, each in its own process
  report           JSON, markdown table, PNG plots, ratios against the targets
  suite            one run: model -> servers -> points -> baselines -> report
  __main__         the command line
"""
