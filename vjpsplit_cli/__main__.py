"""``python -m vjpsplit_cli`` runs the CLI."""

from .cli import main

main()
