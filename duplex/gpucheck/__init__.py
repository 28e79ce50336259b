"""`make gpu-check`: the first run on a GPU host with its own CUDA torch and no package index.

- `host`: what the host's image holds and lacks; `wheels.txt` and `wheels`: what it lacks, as
  wheels downloaded where there is an index (`make gpu-wheels`), at most 64 MiB.
- `__main__`: the runner (`python3 -m duplex.gpucheck`): installs the wheels, runs the phases
  each in a process of its own under its own time limit, writes the summary.
- `profile`: what runs on a GPU (Qwen3-Omni-30B-A3B's shape, 9 minutes) and on the CPU (tiny).
- `phase`: one phase's process; the phases: `environment`, `correctness`, `stages`, `bench`.
- `build`: the models they build in memory; `measure`: CUDA-event timing, host-sync counting,
  memory; `record` and `summary`: the JSON each phase writes as it goes, and the table at the end.

Everything the runner imports before the install (host, profile, record, summary, wheels) is
standard library only.
"""
