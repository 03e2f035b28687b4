"""``python -m posbench <command> ...`` (also what ``torchrun -m posbench`` runs): the posbench CLI."""

from posbench.cli import main

main()
