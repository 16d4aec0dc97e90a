"""`python -m hydra_supervisor` runs the CLI."""

from hydra_supervisor.cli.cli import main

main()
