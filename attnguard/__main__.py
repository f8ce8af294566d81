from .cli import run_as_command

run_as_command()
