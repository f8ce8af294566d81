"""What the tests share: child processes (processes), events (events), tiny models (models),
tensors and float64 references (tensors, kvcache, torch_flash, family_rules), the twins against
the real kernel on a GPU (gpu_twins), the stand-ins and optional packages (packages), and the
inputs of the planner, kernel selection, file-safety and start-up hook tests (plans, selection,
files, hook). tests/README.md says what each holds.

Tests import these modules directly (pytest puts tests/ on ``sys.path``); workers, run as
scripts in child processes, put tests/ on ``sys.path`` first.
"""
