"""What the tests share: tiny models (models), events (events), child processes (processes),
tensors and float64 references (tensors), the stand-ins and optional packages (packages).

Tests import these modules directly (pytest puts tests/ on ``sys.path``); workers, run as
scripts in child processes, put tests/ on ``sys.path`` first. Each module imports only the
standard library at the top (torch in tensors), so a worker that must not import attnguard or
transformers before its moment can still use them.
"""
